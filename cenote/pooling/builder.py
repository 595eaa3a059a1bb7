"""Build a model's pooler from its config and sentence-transformers metadata."""

from __future__ import annotations

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.loader import load_dense_weights
from cenote.pooling.heads import DenseProjector, EmbeddingHead
from cenote.pooling.methods import PoolingMethod
from cenote.pooling.pooler import EmbeddingPooler


def default_pooling_method(model_config: ModelConfig, is_causal: bool) -> PoolingMethod:
    """sentence-transformers' choice when the folder has one; else CLS (encoders) / LAST (decoders)."""
    st = model_config.st_config
    if st is not None and st.pooling is not None:
        return st.pooling
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
    output_size = st.dense_layers[-1].out_features if projector is not None else hidden_size
    return EmbeddingPooler(
        default_pooling_method(model_config, is_causal),
        EmbeddingHead(projector, default_normalize=normalize),
        output_size,
    )
