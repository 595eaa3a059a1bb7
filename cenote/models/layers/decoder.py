"""The attention and MLP blocks of the Llama-family and Gemma 3 decoders.

Both project q/k/v with one fused linear, optionally normalize each head of q and k, rotate them
(RoPE) and attend over the paged KV cache; both MLPs are gated with one fused gate/up linear.
What tells the models apart (biases, the norm class, the activation, the score scale) is passed
in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cenote.kernels import ops
from cenote.models.layers.activation import gated_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.linear import TrunkLinear


class DecoderAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, RoPE, attention, output projection.

    Sizes come from the config (``num_key_value_heads`` defaults to the query heads, ``head_dim``
    to ``hidden_size / heads``); scores are scaled by ``query_scalar ** -0.5`` (default
    ``head_dim``)."""

    def __init__(
        self,
        config: dict[str, Any],
        layer_idx: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: Callable[[int, float], nn.Module] | None = None,  # the norm class, or none
        query_scalar: float | None = None,
        sliding_window: int | None = None,
        causal: bool | None = None,  # the step's flag unless set (see ``Attention``)
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = TrunkLinear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = TrunkLinear(self.q_size, hidden, bias=o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = qk_norm(self.head_dim, eps), qk_norm(self.head_dim, eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            layer_idx,
            float(query_scalar or self.head_dim) ** -0.5,
            sliding_window=sliding_window,
            causal=causal,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size], this call's own tensor
        sizes = [self.q_size, self.kv_size, self.kv_size]
        if self.q_norm is None or self.k_norm is None:
            ops.rotary_(qkv, cos, sin, self.q_size + self.kv_size)  # q and k, in place
            q, k, v = qkv.split(sizes, dim=-1)
        else:
            q, k, v = qkv.split(sizes, dim=-1)
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
            ops.rotary_(q, cos, sin, self.q_size)
            ops.rotary_(k, cos, sin, self.kv_size)
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(out)  # [num_tokens, hidden]


class GatedMLP(nn.Module):
    """``down(act(gate) * up)`` with a fused gate/up projection (``act_and_mul``: SiLU's on
    ``ops.silu_and_mul``)."""

    def __init__(self, config: dict[str, Any], activation: str, bias: bool = False) -> None:
        super().__init__()
        hidden, intermediate = config["hidden_size"], config["intermediate_size"]
        self.gate_up_proj = TrunkLinear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = TrunkLinear(intermediate, hidden, bias=bias)
        self.act_and_mul = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
