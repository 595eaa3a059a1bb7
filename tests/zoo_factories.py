"""Tiny random retrieval models (MPNet, DistilBERT, BERT / DistilBERT masked LMs) written by
transformers' ``save_pretrained``, and as sentence-transformers folders (SentenceTransformer,
CrossEncoder, SparseEncoder) where that is how people use them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from pool_factories import write_tokenizer

VOCAB_SIZE = 128
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # MPNet's order: <pad> = 1

# family -> (config class, model class prefix, special tokens, config)
FAMILIES: dict[str, tuple[str, str, list[str], dict]] = {
    "mpnet": (
        "MPNetConfig",
        "MPNet",
        ROBERTA_SPECIALS,
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            # long enough for relative distances past max_distance (128)
            max_position_embeddings=258,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBert",
        BERT_SPECIALS,
        dict(
            vocab_size=VOCAB_SIZE,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            max_position_embeddings=256,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
            pad_token_id=0,
        ),
    ),
    "bert": (
        "BertConfig",
        "Bert",
        BERT_SPECIALS,
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        ),
    ),
}


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Noise on every parameter (norms and biases too), so a misplaced weight shows."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def make_model(folder: Path, family: str, head: str = "Model", seed: int = 0, **overrides):
    """Save a seeded random ``<Family><head>`` (``Model``, ``ForSequenceClassification``,
    ``ForMaskedLM``) with a word-level tokenizer; returns the transformers model (fp32, eval).

    Only BERT hands segment ids to the model (DistilBERT and MPNet have no token types)."""
    config_class, prefix, specials, config = FAMILIES[family]
    hf_config = getattr(transformers, config_class)(**{**config, **overrides})
    model = perturb(getattr(transformers, f"{prefix}{head}")(hf_config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, specials)
    if family != "bert":
        _drop_token_types(folder)
    return model


def _drop_token_types(folder: Path) -> None:
    import json

    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["model_input_names"] = ["input_ids", "attention_mask"]
    path.write_text(json.dumps(config))


def save_sentence_transformer(
    trunk: Path, target: Path, pooling: str = "mean", normalize: bool = True, **pooling_kwargs
) -> Path:
    """``trunk`` (a saved transformers model) -> Pooling(``pooling``) [-> Normalize], saved by
    sentence-transformers itself into ``target``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    prompts = pooling_kwargs.pop("prompts", None)
    default_prompt_name = pooling_kwargs.pop("default_prompt_name", None)
    transformer = Transformer(str(trunk))
    dimension = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(dimension, pooling, **pooling_kwargs)]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name
    )
    model.save(str(target))
    return target


def save_cross_encoder(raw: Path, target: Path) -> Path:
    """A transformers sequence classifier re-saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(raw), device="cpu").save(str(target))
    return target


def save_sparse_encoder(
    raw: Path, target: Path, strategy: str = "max", activation: str = "relu"
) -> Path:
    """A transformers masked LM -> SpladePooling(``strategy``, ``activation``), saved by
    sentence-transformers' SparseEncoder (a SPLADE folder)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    transformer = Transformer(str(raw), transformer_task="fill-mask")
    pooling = SpladePooling(strategy, activation_function=activation)
    SparseEncoder(modules=[transformer, pooling], device="cpu").save(str(target))
    return target
