"""Rotary position embeddings (neox / ``rotate_half`` layout, as Hugging Face Llama).

Supported ``rope_type``: ``default``, ``linear``, ``llama3`` and ``ntk`` (GTE's fixed or mixed
NTK scaling). Parameters are read from a transformers-5 ``rope_parameters`` dict, or from the
older ``rope_theta`` + ``rope_scaling`` keys.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "ntk")


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json as one dict with ``rope_type`` and ``rope_theta``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params and all(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            f"per-layer-type rope_parameters ({sorted(params)}) are not supported by this model"
        )
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params


def _llama3_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by ``factor``, a smooth ramp in between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _ntk_inv_freq(theta: float, head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """NTK-aware scaling as GTE's remote code (Alibaba-NLP/new-impl) and vLLM apply it at any
    length (https://kexue.fm/archives/9706). Fixed (no ``mixed_b``): ``theta * factor`` as the
    base and every frequency divided by ``factor ** (2 / head_dim)``; mixed: the plain base and
    frequency ``i`` (from 1) divided by ``exp(a * i ** b)``, ``a = log(factor) / (head_dim / 2)
    ** b``."""
    factor = float(params["factor"])
    mixed_b = params.get("mixed_b")
    base = theta if mixed_b is not None else theta * factor
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (base ** (exponents / head_dim))
    if mixed_b is None:
        return inv_freq / factor ** (2 / head_dim)
    b = float(mixed_b)
    a = math.log(factor) / (head_dim / 2) ** b
    index = torch.arange(1, head_dim // 2 + 1, dtype=torch.int64, device="cpu").float()
    return inv_freq / (a * index**b).exp()


class RotaryEmbedding:
    """Inverse frequencies of one model; turns positions into ``cos``/``sin`` tables.

    Not an ``nn.Module`` on purpose: ``inv_freq`` is an fp32 CPU tensor computed at construction
    (with an explicit device, so a ``meta`` build keeps it) that ``to_empty`` and ``.to(dtype)``
    leave alone. ``cos``/``sin`` are computed per step in fp32, exactly as transformers does.
    """

    def __init__(self, head_dim: int, config: dict[str, Any]) -> None:
        params = rope_parameters(config)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        inv_freq = 1.0 / (float(params["rope_theta"]) ** (exponents / head_dim))  # [head_dim / 2]
        if params["rope_type"] == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif params["rope_type"] == "ntk":
            inv_freq = _ntk_inv_freq(float(params["rope_theta"]), head_dim, params)
        elif params["rope_type"] == "llama3":
            max_positions = int(config.get("max_position_embeddings", 2048))
            inv_freq = _llama3_inv_freq(inv_freq, params, max_positions)
        self.inv_freq = inv_freq
        self.head_dim = head_dim
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # copies on other devices

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once (no copy per step; none inside a CUDA
        graph's capture, where a host -> device copy is refused)."""
        if device.type == "cpu":
            return self.inv_freq
        copy = self._inv_freq_on.get(device)
        if copy is None:
            copy = self._inv_freq_on[device] = self.inv_freq.to(device)
        return copy

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [num_tokens]`` -> fp32 ``cos``, ``sin``, each ``[num_tokens, head_dim]``."""
        inv_freq = self._inv_freq(positions.device)
        freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [num_tokens, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [num_tokens, heads * head_dim]`` by ``cos``/``sin [num_tokens, head_dim]``.

    Computed in ``x``'s dtype (the tables are cast to it), as transformers does.
    """
    num_tokens, head_dim = cos.shape
    heads = x.view(num_tokens, -1, head_dim)  # [num_tokens, heads, head_dim]
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    return (heads * cos + _rotate_half(heads) * sin).reshape(num_tokens, -1)
