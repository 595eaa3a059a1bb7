"""BERT, RoBERTa and XLM-RoBERTa encoders over a flat, unpadded token stream."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import (
    TF_LAYER_NORM_NAMES,
    CheckpointMap,
    LinearSlot,
    Slot,
    fused_slots,
    linear_slot,
    linear_slots,
    load_checkpoint,
)
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention, EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import (
    GELU_APPROXIMATE,
    TrunkLinear,
    linear_add_norm,
    linear_gelu,
)
from cenote.models.layers.norm import LayerNorm


class BertEmbeddings(nn.Module):
    def __init__(self, config: dict[str, Any], position_offset: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        self.position_embeddings = Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = Embedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset  # RoBERTa: positions start after padding_idx

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm.normalize_(x)  # [num_tokens, hidden]; x: this step's sum


class BertLayer(nn.Module):
    """Post-norm encoder layer with a fused QKV projection."""

    def __init__(self, config: dict[str, Any], layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-12)
        self.head_dim = hidden // heads
        self.qkv = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(heads, self.head_dim, heads, layer_idx, self.head_dim**-0.5)
        self.attn_out = TrunkLinear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.intermediate = TrunkLinear(hidden, config["intermediate_size"])
        activation = config.get("hidden_act", "gelu")
        self.act = get_activation(activation)
        self.gelu_approximate = GELU_APPROXIMATE.get(activation)  # None: not a GELU
        self.output = TrunkLinear(config["intermediate_size"], hidden)
        self.output_norm = LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask_fn: EncoderMaskFn | None = None) -> torch.Tensor:
        """The GELU runs as the matmul's epilogue (``linear_gelu``), each residual add either
        as the matmul's epilogue or inside the LayerNorm kernel, whichever this CPU runs faster
        (``linear_add_norm``); the norms overwrite the sums they normalize (temporaries of this
        layer)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = linear_add_norm(self.attn_out, self.attn(q, k, v, mask_fn), x, self.attn_norm)
        return self.feed_forward(x)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``output_norm(x + output(act(intermediate(x))))``, the layer's second half."""
        if self.gelu_approximate is None:
            inner = self.act(self.intermediate(x))
        else:
            inner = linear_gelu(self.intermediate, x, self.gelu_approximate)
        return linear_add_norm(self.output, inner, x, self.output_norm)


# a layer's checkpoint module -> ours
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")


class BertModel(nn.Module):
    """The encoder trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]``."""

    is_causal = False
    checkpoint_prefixes: tuple[str, ...] = ("bert.", "model.")

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["hidden_size"]
        self.embeddings = BertEmbeddings(config, self._position_offset(config))
        self.layers = nn.ModuleList(
            BertLayer(config, i) for i in range(config["num_hidden_layers"])
        )
        self.pooler_dense = nn.Linear(self.hidden_size, self.hidden_size)  # HF BertPooler (CLS)
        self.checkpoint_map = self._checkpoint_map()

    @staticmethod
    def _position_offset(config: dict[str, Any]) -> int:
        return 0

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        mask_fn = self._mask_fn(input_ids, positions)
        for layer in self.layers:
            x = layer(x, mask_fn)
        return self._output(x, input_ids, positions)  # [num_tokens, hidden_size]

    def _mask_fn(self, input_ids: torch.Tensor, positions: torch.Tensor) -> EncoderMaskFn | None:
        """What every layer's attention masks in this step (None: nothing)."""
        return None

    def _output(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The trunk's output from the last layer's hidden states (BERT: those)."""
        return hidden

    def _checkpoint_map(self) -> CheckpointMap:
        """The trunk's map; a head extends it (``CheckpointMap.extended``) once it is built."""
        slots = {
            f"embeddings.{name}": Slot(f"embeddings.{name}")
            for name, _ in self.embeddings.named_parameters()
        }
        slots.update(linear_slots("pooler.dense", "pooler_dense"))
        for i in range(len(self.layers)):
            src, dst = f"encoder.layer.{i}", f"layers.{i}"
            slots.update(fused_slots([f"{src}.{module}" for module in _QKV], f"{dst}.qkv"))
            for module, ours in _LAYER_NAMES.items():
                slots.update(linear_slots(f"{src}.{module}", f"{dst}.{ours}"))
        return CheckpointMap(
            slots,
            prefixes=self.checkpoint_prefixes,
            # position-id buffers; the pre-training heads (masked LM, next sentence) and a task
            # head's classifier, when such a checkpoint is served as a trunk
            unused=(r"embeddings\.position_ids", r"cls\.", r"classifier\."),
            renames=TF_LAYER_NORM_NAMES,
            optional=frozenset({"pooler_dense.weight", "pooler_dense.bias"}),  # CLS pooler
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self.checkpoint_map, weights)

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """Where ``<module>.weight`` lives: query/key/value are thirds of the fused ``qkv``
        (``LoRATarget``)."""
        return linear_slot(self, self.checkpoint_map, checkpoint_name)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class RobertaModel(BertModel):
    """RoBERTa / XLM-R: BERT with positions that start after ``padding_idx``.

    Hugging Face numbers positions ``padding_idx + 1 + i`` for the non-padding tokens of a
    sequence; prompts here never contain padding, so the offset is constant.
    """

    checkpoint_prefixes = ("roberta.", "model.")

    @staticmethod
    def _position_offset(config: dict[str, Any]) -> int:
        return int(config.get("pad_token_id", 1)) + 1
