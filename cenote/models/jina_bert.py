"""JinaBERT (jina-embeddings-v2 base / small, jina-reranker-v1) over a flat, unpadded token
stream.

BERT's post-norm layers with ALiBi instead of position embeddings (a per-head linear penalty on
the distance between query and key, symmetric, added inside the attention kernel) and a gated
MLP: ``layernorm(x + wo(act(gate) * value))`` where ``gated_layers`` (no bias) holds ``gate``
then ``value`` and ``act`` follows ``feed_forward_type`` (``geglu``: GELU, ``reglu``: ReLU).
Checkpoints use the remote code's names (jinaai/jina-bert-implementation: BERT's embeddings and
attention, ``mlp.gated_layers``, ``mlp.wo``, ``mlp.layernorm``).

- JinaBertModel (also ``JinaBertForMaskedLM``, as the Hub's jina-embeddings-v2 config.json
  names it; the masked-LM head is not loaded): the trunk, mean-pooled by sentence-transformers.
- JinaBertForSequenceClassification (jina-reranker-v1): ``classifier(tanh(pooler.dense(h_[CLS])))``.

Variants the remote code allows but this file does not compute (absolute positions, BERT's
plain MLP) are refused at load.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.bert_classifiers import TanhPoolerHead
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear, linear_add_norm
from cenote.models.layers.norm import LayerNorm

# feed_forward_type -> the gate's activation
_GATE_ACTIVATIONS = {"geglu": "gelu", "reglu": "relu"}


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's head slopes (Press et al., 2022): ``2 ** (-8 (i + 1) / n)`` for a power of two
    ``n`` heads; otherwise the closest lower power's, then every other slope of the next
    power's."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return geometric(num_heads)
    lower = 2 ** math.floor(math.log2(num_heads))
    return geometric(lower) + geometric(2 * lower)[0::2][: num_heads - lower]


def check_variant(config: dict[str, Any]) -> None:
    """Refuse what this implementation does not compute, naming what it supports."""
    position = config.get("position_embedding_type", "alibi")
    if position != "alibi":
        raise ValueError(
            f"JinaBERT position_embedding_type {position!r} is not supported; supported: alibi"
        )
    kind = config.get("feed_forward_type", "geglu")
    if kind not in _GATE_ACTIVATIONS:
        raise ValueError(
            f"JinaBERT feed_forward_type {kind!r} is not supported; supported: "
            f"{', '.join(_GATE_ACTIVATIONS)}"
        )


class JinaBertLayer(nn.Module):
    """``x = attn_norm(x + attn_out(alibi_attn(qkv x)))``;
    ``x = mlp_norm(x + wo(act(gate x) * value x))``."""

    def __init__(self, config: dict[str, Any], layer_idx: int, slopes: list[float]) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        inner, eps = config["intermediate_size"], config.get("layer_norm_eps", 1e-12)
        head_dim = hidden // heads
        self.qkv = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(
            heads, head_dim, heads, layer_idx, head_dim**-0.5, alibi_slopes=slopes
        )
        self.attn_out = TrunkLinear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.gated_layers = TrunkLinear(hidden, 2 * inner, bias=False)  # [gate; value]
        self.wo = TrunkLinear(inner, hidden)
        self.mlp_norm = LayerNorm(hidden, eps=eps)
        self.act = get_activation(_GATE_ACTIVATIONS[config.get("feed_forward_type", "geglu")])

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = linear_add_norm(self.attn_out, self.attn(q, k, v), x, self.attn_norm)
        gate, value = self.gated_layers(x).chunk(2, dim=-1)  # each [num_tokens, inner]
        return linear_add_norm(self.wo, self.act(gate) * value, x, self.mlp_norm)


# checkpoint name (after ``encoder.layer.N.``) -> ours (after ``layers.N.``)
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "mlp.wo": "wo",
    "mlp.layernorm": "mlp_norm",
}
_QKV = ["attention.self.query", "attention.self.key", "attention.self.value"]


# the CLS pooler and masked-LM head a trunk does not use (a classifier's pooler has a slot,
# which comes first); position-id buffers
_UNUSED = (r"pooler\.", r"cls\.", r"embeddings\.position_ids")


class JinaBertModel(nn.Module):
    """``forward(input_ids, positions, token_type_ids) -> hidden_states [num_tokens, hidden]``;
    positions enter only through ALiBi (distances within a request)."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        check_variant(config)
        self.config = config
        hidden = self.hidden_size = int(config["hidden_size"])
        slopes = alibi_slopes(int(config["num_attention_heads"]))
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        self.token_type_embeddings = Embedding(int(config.get("type_vocab_size", 2)), hidden)
        self.emb_norm = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(
            JinaBertLayer(config, i, slopes) for i in range(config["num_hidden_layers"])
        )
        self.checkpoint_map = CheckpointMap(
            self._trunk_slots(),
            prefixes=("bert.",),
            unused=_UNUSED,
        )

    def _trunk_slots(self) -> dict[str, Slot]:
        slots = {
            "embeddings.word_embeddings.weight": Slot("word_embeddings.weight"),
            "embeddings.token_type_embeddings.weight": Slot("token_type_embeddings.weight"),
            **linear_slots("embeddings.LayerNorm", "emb_norm"),
        }
        for i in range(len(self.layers)):
            src, dst = f"encoder.layer.{i}", f"layers.{i}"
            slots.update(fused_slots([f"{src}.{name}" for name in _QKV], f"{dst}.qkv"))
            for name, ours in _LAYER_NAMES.items():
                slots.update(linear_slots(f"{src}.{name}", f"{dst}.{ours}"))
            slots[f"{src}.mlp.gated_layers.weight"] = Slot(f"{dst}.gated_layers.weight")
        return slots

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.emb_norm.normalize_(x)  # x: this step's sum
        for layer in self.layers:
            x = layer(x)
        return x  # [num_tokens, hidden]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class JinaBertForSequenceClassification(TanhPoolerHead, JinaBertModel):
    """Trunk + pooler (dense + tanh on the CLS token) + ``classifier``, as BERT's head
    (jina-reranker-v1); the head runs in fp32."""
