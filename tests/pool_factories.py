"""Tiny random models for the pooling-surface tests: BERT-family classifiers, Llama-family
decoders (causal LM / sequence classification), written as Hugging Face folders with a
word-level tokenizer that transformers and sentence-transformers can load too."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

VOCAB_SIZE = 128
WORDS = ["yes", "no", "query", "document", "cat", "dog", "sat", "mat", "the", "a", "+", "-"]
_ENCODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
# family -> (config class, special tokens in id order, config overrides)
ENCODERS: dict[str, tuple[str, list[str], dict]] = {
    "bert": ("BertConfig", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], dict(pad_token_id=0)),
    "roberta": (
        "RobertaConfig",
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1),
    ),
    "xlm-roberta": (
        "XLMRobertaConfig",
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1),
    ),
}
_DECODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
DECODERS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "Llama", {}),
    "qwen2": ("Qwen2Config", "Qwen2", {}),
    "qwen3": ("Qwen3Config", "Qwen3", dict(head_dim=16)),
}


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Noise on every parameter (norms and biases too), so a misplaced weight shows."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def write_tokenizer(folder: Path, specials: list[str], pair_segments: bool = True) -> None:
    """WordLevel tokenizer.json over ``specials + WORDS + w* fillers`` (+ tokenizer_config.json
    so AutoTokenizer loads it). Encoders get ``CLS $A SEP [$B SEP]``; decoders nothing."""
    vocab = {tok: i for i, tok in enumerate(specials)}
    for word in WORDS:
        vocab[word] = len(vocab)
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    unk = next(t for t in specials if "unk" in t.lower())
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    names: dict[str, object] = {"unk_token": unk}
    if pair_segments:
        cls, sep, pad = (
            ("[CLS]", "[SEP]", "[PAD]") if specials[0] == "[PAD]" else ("<s>", "</s>", "<pad>")
        )
        second = ":1" if specials[0] == "[PAD]" else ""
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B{second} {sep}{second}",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
        names.update(cls_token=cls, sep_token=sep, pad_token=pad)
        if second:  # BERT tokenizers hand the model segment ids
            names["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    tokenizer.add_special_tokens(specials)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)
    fast.save_pretrained(folder)


def make_encoder_classifier(
    folder: Path, family: str, head: str, seed: int = 0, **overrides
) -> torch.nn.Module:
    """Save a seeded random ``<Family><head>`` (e.g. BertForSequenceClassification)."""
    config_class, specials, family_overrides = ENCODERS[family]
    config = getattr(transformers, config_class)(**{**_ENCODER, **family_overrides, **overrides})
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[family]
    model = _perturb(getattr(transformers, f"{prefix}{head}")(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, specials)
    return model


def make_decoder(folder: Path, variant: str, head: str, seed: int = 0, **overrides):
    """Save a seeded random ``<Variant><head>`` (ForCausalLM / ForSequenceClassification)."""
    config_class, prefix, variant_overrides = DECODERS[variant]
    config = getattr(transformers, config_class)(**{**_DECODER, **variant_overrides, **overrides})
    model = _perturb(getattr(transformers, f"{prefix}{head}")(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, ["<unk>", "<s>", "</s>"], pair_segments=False)
    return model


def set_config(folder: Path, **entries) -> None:
    """Add entries to a saved config.json."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(entries)
    path.write_text(json.dumps(config))


def make_qwen2_reward(
    folder: Path, architecture: str, num_labels: int, seed: int = 0
) -> tuple[torch.nn.Module, torch.nn.Sequential]:
    """Save a seeded random Qwen2 reward model as the Hub's remote-code checkpoints lay it out:
    the ``Qwen2Model`` trunk under ``model.`` and an MLP head ``score.0`` / ``score.2``.
    Returns the trunk and the head (fp32, eval) for hand computation."""
    from safetensors.torch import save_file

    config = transformers.Qwen2Config(**_DECODER)
    trunk = _perturb(transformers.Qwen2Model(config), seed)
    torch.manual_seed(seed + 1)
    hidden = config.hidden_size
    head = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_labels)
    ).eval()
    tensors = {f"model.{name}": t for name, t in trunk.state_dict().items()}
    tensors.update({f"score.{name}": t for name, t in head.state_dict().items()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    config.save_pretrained(folder)
    set_config(folder, architectures=[architecture], num_labels=num_labels)
    write_tokenizer(folder, ["<unk>", "<s>", "</s>"], pair_segments=False)
    return trunk, head
