"""torch's own varlen attention (``torch.nn.attention.varlen.varlen_attn``: flash attention over
a flat stream of requests, CUDA only), feature-detected once: it is new, and its signature has
changed between releases (a causal flag, then a ``window_size`` pair; GQA and scale added)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

_DTYPES = (torch.float16, torch.bfloat16)  # what flash attention computes in
_MAX_HEAD_DIM = 256


@functools.cache
def _varlen_attn() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """The function and its keyword parameters, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available() -> bool:
    return _varlen_attn() is not None


def varlen_applies(q: torch.Tensor) -> bool:
    """Whether ``varlen_attention`` can take queries ``q [tokens, heads, head_dim]``: a CUDA
    tensor in fp16/bf16 with a head size flash attention supports, on a torch that has it."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cuda"
        and q.dtype in _DTYPES
        and head_dim % 8 == 0
        and head_dim <= _MAX_HEAD_DIM
        and varlen_available()
    )


def varlen_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    cu_seq: torch.Tensor,  # [num_requests + 1] int32 cumulative lengths, on q's device
    max_len: int,
    scale: float,
    causal: bool,
) -> torch.Tensor | None:
    """Each request of the stream attending to its own rows (top-left causal when ``causal``)
    -> ``[tokens, heads, head_dim]``; None where this torch's signature cannot express it."""
    found = _varlen_attn()
    if found is None:
        return None
    fn, params = found
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = fn(q, k, v, cu_seq, cu_seq, max_len, max_len, **kwargs)
    return out[0] if isinstance(out, tuple) else out
