"""Tiny BERT-family encoders (BERT, RoBERTa, XLM-R, MPNet, DistilBERT, DeBERTa-v2) saved by
transformers: trunks, sequence / token classifiers and masked LMs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .seeded import hf_config, random_model
from .vocab import (
    BERT_SPECIALS,
    ROBERTA_SPECIALS,
    VOCAB_SIZE,
    write_encoder_tokenizer_json,
    write_tokenizer,
)

TINY_MAX_POSITIONS = 128
TINY_ENCODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=TINY_MAX_POSITIONS,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
_ROBERTA_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
# family -> (transformers class prefix, config overrides, special tokens in id order)
ENCODER_FAMILIES: dict[str, tuple[str, dict, list[str]]] = {
    "bert": ("Bert", dict(pad_token_id=0), BERT_SPECIALS),
    "roberta": ("Roberta", dict(**_ROBERTA_IDS, type_vocab_size=1), ROBERTA_SPECIALS),
    "xlm-roberta": ("XLMRoberta", dict(**_ROBERTA_IDS, type_vocab_size=1), ROBERTA_SPECIALS),
}
# retrieval families -> (class prefix, special tokens, config)
FAMILIES: dict[str, tuple[str, list[str], dict]] = {
    # max_position_embeddings: relative distances past max_distance (128)
    "mpnet": (
        "MPNet",
        ROBERTA_SPECIALS,
        {**TINY_ENCODER, **_ROBERTA_IDS, "max_position_embeddings": 258},
    ),
    "distilbert": (
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
        "Bert",
        BERT_SPECIALS,
        {**TINY_ENCODER, "max_position_embeddings": 256, "pad_token_id": 0},
    ),
    # DeBERTa-v3 as deberta-v3-base / mxbai-rerank-v1 configure it, with small tables: 8 log
    # buckets (exact up to 4 tokens apart), no absolute positions, no token types
    "deberta-v2": (
        "DebertaV2",
        BERT_SPECIALS,
        {
            **TINY_ENCODER,
            "max_position_embeddings": 256,
            "pad_token_id": 0,
            "type_vocab_size": 0,
            "relative_attention": True,
            "position_buckets": 8,
            "max_relative_positions": -1,
            "pos_att_type": ["p2c", "c2p"],
            "share_att_key": True,
            "norm_rel_ebd": "layer_norm",
            "position_biased_input": False,
            "layer_norm_eps": 1e-7,
        },
    ),
}


def make_encoder(folder: Path, family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Save a seeded random ``family`` trunk (``ENCODER_FAMILIES``) with a ``tokenizer.json``
    into ``folder``; returns the transformers model (fp32, eval)."""
    prefix, family_overrides, specials = ENCODER_FAMILIES[family]
    config = hf_config(f"{prefix}Config", TINY_ENCODER, family_overrides, overrides)
    model = random_model(f"{prefix}Model", config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_encoder_tokenizer_json(folder, specials, config.vocab_size)
    return model


def make_encoder_classifier(
    folder: Path, family: str, head: str, seed: int = 0, **overrides
) -> torch.nn.Module:
    """Save a seeded random ``<Family><head>`` (e.g. BertForSequenceClassification) with a
    tokenizer transformers loads too."""
    prefix, family_overrides, specials = ENCODER_FAMILIES[family]
    config = hf_config(f"{prefix}Config", TINY_ENCODER, family_overrides, overrides)
    model = random_model(f"{prefix}{head}", config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, specials)
    return model


def make_model(folder: Path, family: str, head: str = "Model", seed: int = 0, **overrides):
    """Save a seeded random ``<Family><head>`` of ``FAMILIES`` (``Model``,
    ``ForSequenceClassification``, ``ForMaskedLM``) with a word-level tokenizer; returns the
    transformers model (fp32, eval). Only BERT and DeBERTa with ``type_vocab_size`` > 0 hand
    segment ids to the model (DistilBERT and MPNet have no token types)."""
    prefix, specials, config = FAMILIES[family]
    hf = hf_config(f"{prefix}Config", config, overrides)
    model = random_model(f"{prefix}{head}", hf, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, specials)
    if family != "bert" and getattr(hf, "type_vocab_size", 0) == 0:
        path = folder / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text())
        tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
        path.write_text(json.dumps(tokenizer_config))
    return model
