"""Tiny ModernBERT, NomicBERT and T5 / mT5 encoders saved by transformers, with the
retrieval tests' tokenizer, and texts for them."""

from __future__ import annotations

from pathlib import Path

from .seeded import hf_config, random_model
from .vocab import (
    RETRIEVAL_BERT_SPECIALS,
    T5_SPECIALS,
    VOCAB_SIZE,
    write_retrieval_tokenizer,
)

TEXTS = [
    "the cat sat",
    "a dog",
    "query document",
    "the mat . the cat , a dog !",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 12),
    "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52 w53 w54 w55 w56 w57 w58",
]
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
NOMIC_BERT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
)
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


def _save(folder: Path, model, specials: list[str], token_types: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_retrieval_tokenizer(folder, specials, token_types=token_types)
    return model


def make_modernbert(folder: Path, head: str = "Model", seed: int = 0, **overrides):
    """Save a seeded random ``ModernBert<head>`` (``Model`` or ``ForSequenceClassification``)."""
    config = hf_config("ModernBertConfig", MODERNBERT, overrides)
    return _save(folder, random_model(f"ModernBert{head}", config, seed), RETRIEVAL_BERT_SPECIALS)


def make_nomic_bert(folder: Path, seed: int = 0, **overrides):
    config = hf_config("NomicBertConfig", NOMIC_BERT, overrides)
    model = random_model("NomicBertModel", config, seed)
    return _save(folder, model, RETRIEVAL_BERT_SPECIALS, token_types=True)


def make_t5_encoder(folder: Path, seed: int = 0, family: str = "T5", **overrides):
    """Save a seeded random ``T5EncoderModel`` or ``MT5EncoderModel`` (``family`` "MT5";
    ``feed_forward_proj`` relu or gated-gelu)."""
    config = hf_config(f"{family}Config", T5, overrides)
    return _save(folder, random_model(f"{family}EncoderModel", config, seed), T5_SPECIALS)
