"""Which decoder layers attend through a sliding window, read from config.json as transformers
reads it.

A window ``W`` means a query sees the keys fewer than ``W`` positions away: itself and the
``W - 1`` before it (causal), or up to ``W - 1`` on either side (bidirectional). When every layer
slides, KV blocks wholly outside the window of a request's next token are freed
(``kv_free_window``); a model with any full-attention layer keeps all its blocks.
"""

from __future__ import annotations

from typing import Any

_QWEN_TYPES = ("qwen2", "qwen3")  # use_sliding_window + max_window_layers


def layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    """``sliding_attention`` / ``full_attention`` per layer.

    Mistral slides every layer when ``sliding_window`` is set; Qwen2/Qwen3 only with
    ``use_sliding_window``, from layer ``max_window_layers`` on (unless ``layer_types`` says
    otherwise); other models follow ``layer_types`` when it is given, else use full attention.
    """
    window = config.get("sliding_window")
    model_type = config.get("model_type")
    if window is None:
        return ["full_attention"] * num_layers
    if model_type == "mistral":
        return ["sliding_attention"] * num_layers
    if model_type in _QWEN_TYPES and not config.get("use_sliding_window", False):
        return ["full_attention"] * num_layers
    types = config.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries, the model {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(
                f"layer types {sorted(unknown)} are not supported; supported: "
                "sliding_attention, full_attention"
            )
        return list(types)
    if model_type in _QWEN_TYPES:
        first = int(config.get("max_window_layers", num_layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def layer_windows(config: dict[str, Any], num_layers: int) -> list[int | None]:
    """The causal window of each layer (None: full attention)."""
    types = layer_types(config, num_layers)
    if "sliding_attention" not in types:
        return [None] * num_layers
    window = int(config["sliding_window"])
    return [window if kind == "sliding_attention" else None for kind in types]


def kv_free_window(windows: list[int | None]) -> int | None:
    """The window past which KV blocks may be freed: the widest one when every layer slides,
    else None (full-attention layers read every block)."""
    widths = [window for window in windows if window is not None]
    if not widths or len(widths) < len(windows):
        return None
    return max(widths)
