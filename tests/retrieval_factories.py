"""Tiny random retrieval models (ModernBERT, NomicBERT, T5 encoders, ColBERT) saved as the
folders people download: transformers ``save_pretrained`` plus sentence-transformers metadata
where that is how the model is used. Seeded; every parameter gets noise so a misplaced or
missing weight changes the output."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

VOCAB_SIZE = 128
WORDS = ["query", "document", "cat", "dog", "sat", "mat", "the", "a", ".", ",", "!", "?"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]

TEXTS = [
    "the cat sat",
    "a dog",
    "query document",
    "the mat . the cat , a dog !",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 12),
    "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52 w53 w54 w55 w56 w57 w58",
]


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """fp32, eval, noise on every parameter (norms and biases too)."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def write_tokenizer(folder: Path, specials: list[str], token_types: bool = False) -> None:
    """WordLevel tokenizer over ``specials + WORDS + w* fillers`` that transformers and
    sentence-transformers load too. BERT specials: ``[CLS] $A [SEP] ($B [SEP])``; T5: ``$A </s>``."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    for word in WORDS:
        vocab[word] = len(vocab)
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    unk = next(t for t in specials if "unk" in t.lower())
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    names: dict[str, object] = {"unk_token": unk}
    if specials[0] == "[PAD]":
        segment = ":1" if token_types else ""
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair=f"[CLS] $A [SEP] $B{segment} [SEP]{segment}",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        names.update(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])]
        )
        names.update(eos_token="</s>", pad_token="<pad>")
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if token_types else None
    names["model_input_names"] = inputs or ["input_ids", "attention_mask"]
    tokenizer.add_special_tokens(specials)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)
    fast.save_pretrained(folder)


def save_sentence_transformer(
    trunk: Path,
    folder: Path,
    pooling: str,
    dense: list[tuple[int, int, bool]] = (),
    seed: int = 0,
) -> Path:
    """trunk -> ``pooling`` -> Dense(in, out, bias) ... -> Normalize, saved by
    sentence-transformers into ``folder``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    transformer = Transformer(str(trunk), max_seq_length=64)
    modules = [
        transformer,
        Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling),
    ]
    torch.manual_seed(seed)
    for in_features, out_features, bias in dense:
        layer = Dense(in_features, out_features, bias=bias, activation_function=torch.nn.Identity())
        with torch.no_grad():
            layer.linear.weight.normal_(0, in_features**-0.5)
            if bias:
                layer.linear.bias.normal_()
        modules.append(layer)
    model = SentenceTransformer(modules=[*modules, Normalize()], device="cpu")
    model.save(str(folder))
    return folder


# ---- ModernBERT -------------------------------------------------------------------------------

MODERNBERT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    local_attention=8,  # a token sees 4 on either side in local layers
    global_attn_every_n_layers=2,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=3,
    cls_token_id=2,
    sep_token_id=3,
    max_position_embeddings=256,
)


def make_modernbert(folder: Path, head: str = "Model", seed: int = 0, **overrides):
    """Save a seeded random ``ModernBert<head>`` (``Model`` or ``ForSequenceClassification``)."""
    config = transformers.ModernBertConfig(**{**MODERNBERT, **overrides})
    model = perturb(getattr(transformers, f"ModernBert{head}")(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, BERT_SPECIALS)
    return model


# ---- NomicBERT --------------------------------------------------------------------------------

NOMIC_BERT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
)


def make_nomic_bert(folder: Path, seed: int = 0, **overrides):
    config = transformers.NomicBertConfig(**{**NOMIC_BERT, **overrides})
    model = perturb(transformers.NomicBertModel(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, BERT_SPECIALS, token_types=True)
    return model


# ---- T5 encoders ------------------------------------------------------------------------------

T5 = dict(
    vocab_size=VOCAB_SIZE,
    d_model=32,
    d_kv=16,  # inner dim 64 != d_model
    d_ff=48,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=20,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def make_t5_encoder(folder: Path, seed: int = 0, family: str = "T5", **overrides):
    """Save a seeded random ``T5EncoderModel`` or ``MT5EncoderModel`` (``family`` "MT5";
    ``feed_forward_proj`` relu or gated-gelu)."""
    config = getattr(transformers, f"{family}Config")(**{**T5, **overrides})
    model = perturb(getattr(transformers, f"{family}EncoderModel")(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, T5_SPECIALS)
    return model
