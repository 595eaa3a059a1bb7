"""What the Llama-family and Gemma 3 models share around their trunks: the KV-cache sizes, the
forward call and checkpoint loading, where Hugging Face's separate q/k/v and gate/up tensors
load as row blocks (shards) of the fused ``qkv_proj`` / ``gate_up_proj``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.models.checkpoint_map import LinearSlot
from cenote.models.layers.decoder import DecoderAttention
from cenote.models.layers.quant import QuantizedWeight, QuantLinear
from cenote.models.sliding_window import kv_free_window
from cenote.models.weights import copy_weight

# checkpoint module -> (our fused module, shard)
_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}  # their shards, in order


def map_name(name: str) -> tuple[str, str | None]:
    """Our parameter name for a checkpoint name, and the shard of it the tensor fills."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _SHARDS:
        fused, shard = _SHARDS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, None


class DecoderBase(nn.Module):
    """Trunk (``self.model``, set by the subclass) + weight loading.

    ``forward(input_ids [T], positions [T], token_type_ids=None) -> hidden [T, hidden]`` (final
    norm applied). ``num_layers``, ``num_kv_heads`` and ``head_dim`` size the KV cache;
    ``kv_sliding_window`` (set when every layer slides) lets it free blocks behind the window.
    """

    is_causal = True
    model: nn.Module
    # checkpoint tensors that are no parameters (buffers transformers saves)
    skipped_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.hidden_size: int = config["hidden_size"]
        # module name -> its quantized shards, for the modules ``prepare_quantized`` emptied
        self._quantized_parts: dict[str, dict[str | None, QuantizedWeight]] = {}

    def _set_sizes(self, windows: list[int | None], attention: DecoderAttention) -> None:
        """The KV-cache sizes and shard rows, from the layers' windows and one layer's attention
        (every layer has the same sizes)."""
        self.num_layers = len(windows)
        self.num_kv_heads: int = attention.num_kv_heads
        self.head_dim: int = attention.head_dim
        self.kv_sliding_window = kv_free_window(windows)
        self.attention_windows = tuple(sorted(set(windows), key=lambda window: window or 0))
        q, kv, intermediate = attention.q_size, attention.kv_size, self.config["intermediate_size"]
        self._shard_rows = {
            "q": (0, q),
            "k": (q, q + kv),
            "v": (q + kv, q + 2 * kv),
            "gate": (0, intermediate),
            "up": (intermediate, 2 * intermediate),
        }

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # token_type_ids unused: decoders have no token types
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint name as the full model names it (a base model's lacks ``model.``)."""
        return name

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]:
        """Copy checkpoint tensors into the module; returns the names of our parameters loaded.

        Fused shards are reported as ``"<param>[<shard>]"``. Raises on a checkpoint tensor this
        model has no place for (other than saved buffers and an unused ``lm_head``).
        ``QuantizedWeight``s go to the modules ``prepare_quantized`` chose.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.skipped_suffixes):
                continue
            our_name, shard = map_name(self._checkpoint_name(name))
            if isinstance(tensor, QuantizedWeight):
                module_name = our_name.rpartition(".")[0]
                if module_name in self._quantized_parts:
                    self._quantized_parts[module_name][shard] = tensor
                elif name != "lm_head.weight":
                    raise ValueError(f"quantized tensor {name!r} has no quantized place here")
                continue
            if name == "lm_head.weight" and name not in params:
                continue  # tied embeddings, or a classifier converted from a causal LM
            if our_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            target: torch.Tensor = params[our_name]
            if shard is not None:
                start, end = self._shard_rows[shard]
                target = target[start:end]
            copy_weight(target, tensor, name)
            loaded.add(our_name if shard is None else f"{our_name}[{shard}]")
        return loaded

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """Where ``<module>.weight`` lives: q/k/v and gate/up are row blocks of the fused
        ``qkv_proj`` / ``gate_up_proj`` (``LoRATarget``)."""
        our_name, shard = map_name(self._checkpoint_name(checkpoint_name))
        module_name, _, leaf = our_name.rpartition(".")
        if leaf != "weight":
            return None
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        if not isinstance(module, (nn.Linear, QuantLinear)):
            return None
        start, end = (0, module.out_features) if shard is None else self._shard_rows[shard]
        return LinearSlot(module_name, start, end)

    def required_parameters(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            module = name.split(".")[-2]
            if module in FUSED:
                names.update(f"{name}[{shard}]" for shard in FUSED[module])
            else:
                names.add(name)
        return names
