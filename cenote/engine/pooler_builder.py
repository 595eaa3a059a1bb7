"""Build a model's poolers from its config and sentence-transformers metadata."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.interfaces import CausalLM, MaskedLM, Model, SequenceScorer
from cenote.models.loader import load_dense_weights
from cenote.models.registry import ModelEntry
from cenote.pooling.activation import classifier_activation
from cenote.pooling.bge_m3 import ColbertVectorPooler, LexicalColbertHeads, LexicalWeightPooler
from cenote.pooling.heads import DenseProjector, EmbeddingHead
from cenote.pooling.interface import Pooler
from cenote.pooling.methods import PoolingMethod, parse_pooling_method
from cenote.pooling.pooler import ClassifierPooler, DispatchPooler, EmbeddingPooler
from cenote.pooling.sparse import SparsePooler
from cenote.tasks import PoolingTask


def default_pooling_method(model_config: ModelConfig, is_causal: bool) -> PoolingMethod:
    """The user's ``pooler_config``, else sentence-transformers' choice when the folder has one,
    else CLS (encoders) / LAST (decoders)."""
    if model_config.pooler_config.pooling_type is not None:
        return parse_pooling_method(model_config.pooler_config.pooling_type.lower())
    st = model_config.st_config
    if st is not None and st.pooling is not None:
        return parse_pooling_method(st.pooling)
    return "last" if is_causal else "cls"


def _dense_projector(model_config: ModelConfig) -> DenseProjector | None:
    st = model_config.st_config
    if st is None or not st.dense_layers:
        return None
    layers = []
    for dense in st.dense_layers:
        linear = nn.Linear(dense.in_features, dense.out_features, bias=dense.bias)
        weights = load_dense_weights(dense.path)
        with torch.no_grad():
            linear.weight.copy_(weights["linear.weight"])
            if dense.bias:
                linear.bias.copy_(weights["linear.bias"])
        layers.append((linear, dense.activation))
    return DenseProjector(layers)


def build_embedding_pooler(
    model_config: ModelConfig, hidden_size: int, is_causal: bool
) -> EmbeddingPooler:
    """Normalization defaults to the sentence-transformers pipeline, or on (as vLLM) without one."""
    st = model_config.st_config
    projector = _dense_projector(model_config)
    normalize = st.normalize if st is not None else True
    if model_config.pooler_config.normalize is not None:
        normalize = model_config.pooler_config.normalize
    output_size = hidden_size
    if st is not None and projector is not None:
        output_size = st.dense_layers[-1].out_features
    return EmbeddingPooler(
        default_pooling_method(model_config, is_causal),
        EmbeddingHead(projector, default_normalize=normalize),
        output_size,
        include_prompt=st.include_prompt if st is not None else True,
    )


def _st_settings(model_config: ModelConfig) -> dict[str, Any]:
    path = model_config.path / "config_sentence_transformers.json"
    if model_config.gguf_file is not None or not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        settings: dict[str, Any] = json.load(f)
    return settings


def build_classifier_pooler(model_config: ModelConfig, model: Model) -> ClassifierPooler:
    """A model with a classification head (``SequenceScorer``) pools as the head declares
    (CLS for encoders, LAST for decoders; none: token tasks only) with the activation it fixes,
    else the config's; a causal LM's LM head scores tokens over the vocabulary (process reward,
    token tasks only)."""
    if isinstance(model, SequenceScorer):
        activation = model.default_activation or classifier_activation(
            model_config.hf_config, model.num_labels, _st_settings(model_config)
        )
        return ClassifierPooler(
            model.classifier_pooling,
            model.compute_scores,
            activation,
            model.num_labels,
            model.step_tag_id,
        )
    if not isinstance(model, CausalLM):
        raise TypeError(f"{type(model).__name__} has neither a classification nor an LM head")
    lm_head = model
    dtype = model_config.dtype

    def lm_head_scores(hidden: torch.Tensor) -> torch.Tensor:
        return lm_head.compute_logits(hidden.to(dtype))  # [N, vocab] fp32

    return ClassifierPooler(None, lm_head_scores, "softmax", model_config.vocab_size)


def build_pooler(
    model_config: ModelConfig, model: Model, entry: ModelEntry
) -> DispatchPooler | None:
    """One pooler per pooling task the registry entry declares; None for generation only."""
    poolers: dict[PoolingTask, Pooler] = {}
    if isinstance(model, LexicalColbertHeads):  # BGE-M3: its own sparse and token heads
        poolers["embed"] = build_embedding_pooler(model_config, model.hidden_size, False)
        poolers["embed_sparse"] = LexicalWeightPooler(model, model_config.vocab_size)
        poolers["token_embed"] = ColbertVectorPooler(model)
        return DispatchPooler(poolers)
    if "embed" in entry.tasks or "token_embed" in entry.tasks:
        embedding = build_embedding_pooler(model_config, model.hidden_size, entry.is_causal)
        poolers.update({t: embedding for t in ("embed", "token_embed") if t in entry.tasks})
    if "classify" in entry.tasks or "token_classify" in entry.tasks:
        classifier = build_classifier_pooler(model_config, model)
        served = classifier.get_supported_tasks()
        for task in ("classify", "token_classify"):
            if task in entry.tasks:
                assert task in served, f"{entry.class_name} declares {task} but cannot serve it"
                poolers[task] = classifier
    if "embed_sparse" in entry.tasks:
        poolers["embed_sparse"] = build_sparse_pooler(model_config, model)
    return DispatchPooler(poolers) if poolers else None


def build_sparse_pooler(model_config: ModelConfig, model: Model) -> SparsePooler:
    """SPLADE over the model's masked-LM head (``MaskedLM``): the folder's SpladePooling, else
    max over log1p(relu) (SPLADE v2+, as text-embeddings-inference); the model's
    ``max_active_dims`` from config_sentence_transformers.json."""
    if not isinstance(model, MaskedLM):
        raise TypeError(f"{type(model).__name__} has no masked-LM head for sparse embeddings")
    st = model_config.st_config
    sparse = st.sparse_pooling if st is not None else None
    strategy, activation = (sparse.strategy, sparse.activation) if sparse else ("max", "relu")
    return SparsePooler(
        model.compute_mlm_logits,
        strategy,
        activation,
        model_config.vocab_size,
        _st_settings(model_config).get("max_active_dims"),
    )
