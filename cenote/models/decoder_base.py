"""What the Llama-family and Gemma 3 models share around their trunks: the KV-cache sizes, the
forward call and checkpoint loading, where Hugging Face's separate q/k/v and gate/up tensors
load as row blocks (shards) of the fused ``qkv_proj`` / ``gate_up_proj``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.models.checkpoint_map import (
    CheckpointMap,
    LinearSlot,
    Slot,
    linear_slot,
    load_checkpoint,
)
from cenote.models.layers.decoder import DecoderAttention
from cenote.models.layers.quant import QuantizedWeight
from cenote.models.sliding_window import kv_free_window

# our fused module -> the checkpoint modules it holds, in row order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# checkpoint tensors that are no parameters: buffers transformers saves (Gemma's embed_scale),
# and an LM head the model has no place for (tied embeddings; a classifier converted from a
# causal LM); a model with its own ``lm_head`` has a slot for it, which comes first
DECODER_UNUSED = (r".*rotary_emb\.inv_freq$", r".*embed_scale$", r"lm_head\.weight$")


class DecoderBase(nn.Module):
    """Trunk (``self.model``, set by the subclass) + weight loading.

    ``forward(input_ids [T], positions [T], token_type_ids=None) -> hidden [T, hidden]`` (final
    norm applied). ``num_layers``, ``num_kv_heads`` and ``head_dim`` size the KV cache;
    ``kv_sliding_window`` (set when every layer slides) lets it free blocks behind the window.
    """

    is_causal = True
    model: nn.Module
    checkpoint_map: CheckpointMap  # set by ``_set_sizes``; heads extend it

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.hidden_size: int = config["hidden_size"]
        # module name -> its quantized shards, for the modules ``prepare_quantized`` emptied
        self._quantized_parts: dict[str, dict[int | None, QuantizedWeight]] = {}

    def _set_sizes(self, windows: list[int | None], attention: DecoderAttention) -> None:
        """The KV-cache sizes and shard rows, from the layers' windows and one layer's attention
        (every layer has the same sizes)."""
        self.num_layers = len(windows)
        self.num_kv_heads: int = attention.num_kv_heads
        self.head_dim: int = attention.head_dim
        self.kv_sliding_window = kv_free_window(windows)
        self.attention_windows = tuple(sorted(set(windows), key=lambda window: window or 0))
        self.checkpoint_map = self._trunk_map(attention)

    def _trunk_map(self, attention: DecoderAttention) -> CheckpointMap:
        """Hugging Face names, ``model.`` optional (a base model's checkpoint lacks it); q/k/v
        and gate/up are row blocks of the fused projections; other parameters keep their
        names."""
        q, kv, intermediate = attention.q_size, attention.kv_size, self.config["intermediate_size"]
        rows = {
            "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "gate_up_proj": [(0, intermediate), (intermediate, 2 * intermediate)],
        }
        slots: dict[str, Slot] = {}
        for name, _ in self.named_parameters():
            key = name.removeprefix("model.")
            module, _, kind = key.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf in FUSED:
                for shard, part in enumerate(FUSED[leaf]):
                    slots[f"{parent}.{part}.{kind}"] = Slot(
                        name, shard, len(FUSED[leaf]), rows[leaf][shard]
                    )
            else:
                slots[key] = Slot(name)
        return CheckpointMap(slots, prefixes=("model.",), unused=DECODER_UNUSED)

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # token_type_ids unused: decoders have no token types
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]:
        """``load_checkpoint`` by ``checkpoint_map``; ``QuantizedWeight``s go to the modules
        ``prepare_quantized`` emptied."""
        return load_checkpoint(self, self.checkpoint_map, weights, self._place_quantized)

    def _place_quantized(self, slot: Slot, tensor: QuantizedWeight) -> bool:
        parts = self._quantized_parts.get(slot.param.rpartition(".")[0])
        if parts is None:
            return False
        parts[slot.shard] = tensor
        return True

    def weight_shards(self, module_name: str) -> set[int | None]:
        """The shards a module's weight loads in (``{None}``: one tensor)."""
        return {
            slot.shard
            for slot in self.checkpoint_map.slots.values()
            if slot.param == f"{module_name}.weight"
        }

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """Where ``<module>.weight`` lives: q/k/v and gate/up are row blocks of the fused
        ``qkv_proj`` / ``gate_up_proj`` (``LoRATarget``)."""
        return linear_slot(self, self.checkpoint_map, checkpoint_name)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()
