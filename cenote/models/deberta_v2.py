"""DeBERTa-v2 / v3 encoders and their sequence-classification head (mxbai-rerank-v1, DeBERTa
cross-encoders) over a flat, unpadded token stream.

BERT's post-norm layers with disentangled attention: the score of query i and key j adds to
``q_i . k_j`` a content-to-position term ``q_i . pk[c(i, j)]`` (``c2p``) and a
position-to-content term ``k_j . pq[c(i, j)]`` (``p2c``), the sum scaled by
``1 / sqrt(head_dim * (1 + number of terms))``. ``pk`` / ``pq`` project one table of relative
position embeddings shared by all layers (LayerNorm'ed under ``norm_rel_ebd: layer_norm``)
through the layer's own key / query projections (``share_att_key``) or its ``pos_key_proj`` /
``pos_query_proj``; ``c(i, j)`` is ``i - j`` (log-bucketed when ``position_buckets`` > 0)
shifted by the table's half size and clamped into it. Absolute position embeddings are added
only with ``position_biased_input``, token types only when ``type_vocab_size`` > 0, and
deberta-v2-xlarge's convolution (``conv_kernel_size``) runs after the first layer.

- DebertaV2ForSequenceClassification: ``classifier(act(pooler.dense(h_[CLS])))`` (ContextPooler)

The position terms reach ``Attention`` as an additive score bias (its ``mask_fn``), so these
layers run on its SDPA path, one call per run of equal-length requests, with the bias built as
``[requests, heads, n, n]`` by gathering the ``q . pk`` / ``k . pq`` products; the varlen
kernel's plain softmax(QK^T) cannot hold it. What would make it fast: a kernel that adds both
terms inside its tile loop, reading the per-request products ``[n, 2 * span]`` by bucket index
instead of materializing ``[n, n]`` biases (FlashDeBERTa does this on GPUs), and a strided view
(Transformer-XL's relative shift) instead of the gather where no bucket or clamp applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.forward_context import get_attention_metadata
from cenote.models.bert import BertLayer
from cenote.models.bert_classifiers import num_labels_of
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention, EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear, linear_add_norm, linear_fp32
from cenote.models.layers.norm import LayerNorm

_LAYER_NORM_EPS = 1e-7  # DebertaV2Config's default


@dataclass(frozen=True)
class RelativeAttention:
    """How a config asks for relative positions, with transformers' defaults."""

    enabled: bool  # relative_attention
    c2p: bool  # content-to-position term
    p2c: bool  # position-to-content term
    share_att_key: bool  # the layer's key / query projections also project positions
    span: int  # half the relative-embedding table: position_buckets, else max_relative_positions
    position_buckets: int  # > 0: log buckets
    max_relative_positions: int  # max_position_embeddings when the config has none

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RelativeAttention:
        kinds = config.get("pos_att_type") or []
        if isinstance(kinds, str):
            kinds = [kind.strip() for kind in kinds.lower().split("|")]
        max_relative = int(config.get("max_relative_positions", -1))
        if max_relative < 1:
            max_relative = int(config.get("max_position_embeddings", 512))
        buckets = int(config.get("position_buckets", -1))
        return cls(
            enabled=bool(config.get("relative_attention", False)),
            c2p="c2p" in kinds,
            p2c="p2c" in kinds,
            share_att_key=bool(config.get("share_att_key", False)),
            span=buckets if buckets > 0 else max_relative,
            position_buckets=buckets,
            max_relative_positions=max_relative,
        )

    @property
    def scale_factor(self) -> float:
        """transformers divides by sqrt(head_dim * this), whether or not relative_attention."""
        return float(1 + self.c2p + self.p2c)

    @property
    def has_terms(self) -> bool:
        return self.enabled and (self.c2p or self.p2c)

    def table_index(self, length: int, device: torch.device) -> Tensor:
        """``[length, length]`` row of the relative-embedding table for query i and key j."""
        positions = torch.arange(length, device=device)
        relative = positions[:, None] - positions[None, :]  # query - key
        if self.position_buckets > 0:
            relative = log_bucket(relative, self.position_buckets, self.max_relative_positions)
        return torch.clamp(relative + self.span, 0, 2 * self.span - 1)


def log_bucket(relative: Tensor, buckets: int, max_position: int) -> Tensor:
    """transformers' ``make_log_bucket_position``: distances under ``buckets // 2`` as they are,
    farther ones log-spaced up to ``max_position`` (same fp32 operations, same rounding)."""
    sign = torch.sign(relative)
    mid = buckets // 2
    near = (relative < mid) & (relative > -mid)
    distance = torch.where(near, torch.tensor(mid - 1).type_as(relative), relative.abs())
    log_scale = torch.log(torch.tensor((max_position - 1) / mid, device=relative.device))
    far = torch.ceil(torch.log(distance / mid) / log_scale * (mid - 1)) + mid
    return torch.where(distance <= mid, relative.type_as(far), far * sign).long()


@dataclass(frozen=True)
class TableWindow:
    """The table rows one request length reads: gather ``index`` from columns ``[lo, hi)``."""

    index: Tensor  # [length, length] int64, relative to lo
    lo: int
    hi: int


class StepPositions:
    """One step's table windows, one per request length, shared by every layer."""

    def __init__(self, relative: RelativeAttention) -> None:
        self.relative = relative
        self.windows: dict[int, TableWindow] = {}

    def window(self, length: int, device: torch.device) -> TableWindow:
        if length not in self.windows:
            index = self.relative.table_index(length, device)
            lo, hi = int(index.min()), int(index.max()) + 1
            self.windows[length] = TableWindow(index - lo, lo, hi)
        return self.windows[length]


class DebertaV2Embeddings(nn.Module):
    """Word (+ absolute position) (+ token type) embeddings, projected to the hidden size when
    ``embedding_size`` differs, then LayerNorm."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        size = int(config.get("embedding_size") or hidden)
        self.word_embeddings = Embedding(config["vocab_size"], size)
        self.position_embeddings = (
            Embedding(config["max_position_embeddings"], size)
            if config.get("position_biased_input", True)
            else None
        )
        types = int(config.get("type_vocab_size", 0))
        self.token_type_embeddings = Embedding(types, size) if types > 0 else None
        self.embed_proj = nn.Linear(size, hidden, bias=False) if size != hidden else None
        self.LayerNorm = LayerNorm(hidden, eps=config.get("layer_norm_eps", _LAYER_NORM_EPS))

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None
    ) -> Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        return self.LayerNorm.normalize_(x)  # [num_tokens, hidden]; x: this step's temporary


class DebertaV2Layer(BertLayer):
    """``BertLayer`` whose attention adds the disentangled position terms; ``project_positions``
    (after loading) turns the shared relative-embedding table into this layer's ``pk`` / ``pq``."""

    pos_key: Tensor | None
    pos_query: Tensor | None

    def __init__(self, config: dict[str, Any], layer_idx: int, relative: RelativeAttention):
        super().__init__(config, layer_idx)
        heads = config["num_attention_heads"]
        scale = (self.head_dim * relative.scale_factor) ** -0.5
        self.attn = Attention(heads, self.head_dim, heads, layer_idx, scale)
        self.relative = relative
        own = relative.enabled and not relative.share_att_key
        hidden = config["hidden_size"]
        self.pos_key_proj = TrunkLinear(hidden, hidden) if own and relative.c2p else None
        self.pos_query_proj = TrunkLinear(hidden, hidden) if own and relative.p2c else None
        # [heads, head_dim, 2 * span], set by project_positions; buffers, so that they move
        # with the module, left out of state dicts
        self.register_buffer("pos_key", None, persistent=False)
        self.register_buffer("pos_query", None, persistent=False)

    def project_positions(self, table: Tensor) -> None:
        """``table [2 * span, hidden]``: the normalized relative embeddings."""
        query, key, _ = self.qkv(table).chunk(3, dim=-1)
        if self.pos_key_proj is not None:
            key = self.pos_key_proj(table)
        if self.pos_query_proj is not None:
            query = self.pos_query_proj(table)
        heads = self.attn.num_heads

        def per_head(x: Tensor) -> Tensor:
            return x.reshape(-1, heads, self.head_dim).permute(1, 2, 0).contiguous()

        self.pos_key = per_head(key) if self.relative.c2p else None
        self.pos_query = per_head(query) if self.relative.p2c else None

    def forward(  # type: ignore[override]  # the step's positions, not a mask, come in
        self, x: Tensor, positions: StepPositions | None
    ) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask_fn = None if positions is None else self._position_bias(q, k, positions)
        x = linear_add_norm(self.attn_out, self.attn(q, k, v, mask_fn), x, self.attn_norm)
        return self.feed_forward(x)

    def _position_bias(self, q: Tensor, k: Tensor, positions: StepPositions) -> EncoderMaskFn:
        """The c2p + p2c scores (scaled) of the equal-length requests on ``rows``."""
        heads, dim = self.attn.num_heads, self.head_dim
        projected = (self.pos_key is not None, self.pos_query is not None)
        assert projected == (self.relative.c2p, self.relative.p2c), "post_load projects them"

        def mask_fn(rows: slice, num_requests: int, length: int) -> Tensor:
            window = positions.window(length, q.device)
            shape = (num_requests, length, heads, dim)
            index = window.index.expand(num_requests, heads, length, length)
            bias = q.new_zeros(())
            if self.pos_key is not None:  # q_i . pk[c(i, j)]
                table = self.pos_key[..., window.lo : window.hi]  # [heads, dim, width]
                scores = torch.matmul(q[rows].view(shape).transpose(1, 2), table)
                bias = bias + scores.gather(-1, index)  # [requests, heads, i, j]
            if self.pos_query is not None:  # k_j . pq[c(i, j)]
                table = self.pos_query[..., window.lo : window.hi]
                scores = torch.matmul(k[rows].view(shape).transpose(1, 2), table)
                bias = bias + scores.gather(-1, index.transpose(-1, -2)).transpose(-1, -2)
            return bias * self.attn.scale  # [requests, heads, length, length]

        return mask_fn


class ConvLayer(nn.Module):
    """deberta-v2-xlarge's convolution after the first layer: ``LayerNorm(h + act(conv(x)))``
    over the embeddings ``x``, each request zero-padded at both ends."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, size = config["hidden_size"], int(config["conv_kernel_size"])
        if size % 2 == 0:
            raise ValueError(f"DeBERTa conv_kernel_size must be odd, got {size}")
        groups = int(config.get("conv_groups", 1))
        self.conv = nn.Conv1d(hidden, hidden, size, padding=(size - 1) // 2, groups=groups)
        self.act = get_activation(config.get("conv_act", "tanh"))
        self.LayerNorm = LayerNorm(hidden, eps=config.get("layer_norm_eps", _LAYER_NORM_EPS))

    def forward(self, embeddings: Tensor, hidden: Tensor, lengths: list[int]) -> Tensor:
        # requests laid out ``pad`` zero rows apart, so no window reaches into a neighbour
        pad = (self.conv.kernel_size[0] - 1) // 2
        num_real = sum(lengths)
        device = embeddings.device
        counts = torch.tensor(lengths, device=device)
        request = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
        rows = torch.arange(num_real, device=device) + pad * (request + 1)
        spaced = embeddings.new_zeros(num_real + pad * (len(lengths) + 1), embeddings.shape[1])
        spaced[rows] = embeddings[:num_real]
        out = torch.zeros_like(hidden)  # the batch's padding rows stay 0
        out[:num_real] = self.conv(spaced.T.unsqueeze(0))[0].T[rows]
        return self.LayerNorm(hidden + self.act(out))


# checkpoint module after ``encoder.layer.N.`` -> ours, where they differ
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_QKV = ["attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"]


class DebertaV2Model(nn.Module):
    """``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]`` (transformers'
    ``last_hidden_state``)."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size: int = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_size = config.get("attention_head_size")
        if head_size is not None and int(head_size) * heads != self.hidden_size:
            raise ValueError(
                f"DeBERTa attention_head_size {head_size} x {heads} heads != hidden_size "
                f"{self.hidden_size}; only heads that split the hidden size are supported"
            )
        eps = config.get("layer_norm_eps", _LAYER_NORM_EPS)
        layer_config = {
            **config,
            "layer_norm_eps": eps,
            "hidden_act": config.get("hidden_act", "gelu"),
        }
        self.relative = RelativeAttention.from_config(config)
        self.embeddings = DebertaV2Embeddings(config)
        self.layers = nn.ModuleList(
            DebertaV2Layer(layer_config, i, self.relative)
            for i in range(config["num_hidden_layers"])
        )
        self.rel_embeddings = (
            Embedding(2 * self.relative.span, self.hidden_size) if self.relative.enabled else None
        )
        norm_kinds = str(config.get("norm_rel_ebd", "none")).lower().split("|")
        normalized = "layer_norm" in (kind.strip() for kind in norm_kinds)
        self.rel_norm = LayerNorm(self.hidden_size, eps=eps) if normalized else None
        self.conv = ConvLayer(config) if int(config.get("conv_kernel_size", 0)) > 0 else None
        self.checkpoint_map = CheckpointMap(
            self._trunk_slots(),
            prefixes=("deberta.",),
            unused=self._unused(),
        )

    def _trunk_slots(self) -> dict[str, Slot]:
        names = [f"embeddings.{name}" for name, _ in self.embeddings.named_parameters()]
        slots = {name: Slot(name) for name in names}
        if self.rel_embeddings is not None:
            slots["encoder.rel_embeddings.weight"] = Slot("rel_embeddings.weight")
        if self.rel_norm is not None:
            slots.update(linear_slots("encoder.LayerNorm", "rel_norm"))
        if self.conv is not None:
            slots.update(linear_slots("encoder.conv.conv", "conv.conv"))
            slots.update(linear_slots("encoder.conv.LayerNorm", "conv.LayerNorm"))
        for i, layer in enumerate(self.layers):
            src, dst = f"encoder.layer.{i}", f"layers.{i}"
            slots.update(fused_slots([f"{src}.{name}" for name in _QKV], f"{dst}.qkv"))
            for name, ours in _LAYER_NAMES.items():
                slots.update(linear_slots(f"{src}.{name}", f"{dst}.{ours}"))
            if layer.pos_key_proj is not None:
                slots.update(
                    linear_slots(f"{src}.attention.self.pos_key_proj", f"{dst}.pos_key_proj")
                )
            if layer.pos_query_proj is not None:
                slots.update(
                    linear_slots(f"{src}.attention.self.pos_query_proj", f"{dst}.pos_query_proj")
                )
        return slots

    def _unused(self) -> tuple[str, ...]:
        """transformers ignores a position table the config does not use; the masked-LM heads
        of pre-trained checkpoints are not ours."""
        unused: tuple[str, ...] = (
            "embeddings.position_ids",
            "lm_predictions.",
            "mask_predictions.",
        )
        if self.embeddings.position_embeddings is None:
            unused += ("embeddings.position_embeddings.",)
        return unused

    def post_load(self) -> None:
        """Project the relative-embedding table through every layer, once (it depends on the
        weights only)."""
        if self.rel_embeddings is None:
            return
        with torch.no_grad():
            table = self.rel_embeddings.weight
            if self.rel_norm is not None:
                table = self.rel_norm(table)
            for layer in self.layers:
                assert isinstance(layer, DebertaV2Layer)
                layer.project_positions(table)

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        step = StepPositions(self.relative) if self.relative.has_terms else None
        embeddings = x
        for i, layer in enumerate(self.layers):
            x = layer(x, step)
            if i == 0 and self.conv is not None:
                x = self.conv(embeddings, x, get_attention_metadata().query_lens)
        return x  # [num_tokens, hidden]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class DebertaV2ForSequenceClassification(ScorerDefaults, DebertaV2Model):
    """Trunk + ContextPooler (``pooler.dense`` and ``pooler_hidden_act`` on the first token) +
    ``classifier``; the head runs in fp32."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        config, hidden = self.config, self.hidden_size
        self.num_labels = num_labels_of(config)
        pooler_size = int(config.get("pooler_hidden_size") or hidden)
        self.pooler_dense = nn.Linear(pooler_size, pooler_size)
        self.pooler_act = get_activation(config.get("pooler_hidden_act", "gelu"))
        self.classifier = nn.Linear(hidden, self.num_labels)
        head = {
            **linear_slots("pooler.dense", "pooler_dense"),
            **linear_slots("classifier", "classifier"),
        }
        self.checkpoint_map = self.checkpoint_map.extended(head)

    def compute_scores(self, pooled: Tensor) -> Tensor:
        """``pooled [N, hidden]`` (first-token rows) -> fp32 logits ``[N, num_labels]``."""
        x = self.pooler_act(linear_fp32(pooled, self.pooler_dense))
        return linear_fp32(x, self.classifier)
