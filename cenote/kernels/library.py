"""The ``cenote`` torch library's ops, typed: ``torch.ops`` carry no static types, so the
Protocols here declare the schemas csrc/registration.cpp registers. Each op is resolved once per
process to its overload (a lookup per call made one-stream decode 12 % slower).

Layers do not call these handles: they call cenote/kernels/ops.py, which decides kernel or torch.
Kernel tests and benchmarks use them to reach an op directly.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol, cast

from cenote.kernels.build import kernel_library

if TYPE_CHECKING:
    import torch


class QuantOps(Protocol):
    """The functions of the quantized-matmul / fused-layer module that cenote calls (the
    ``cenote`` torch library: csrc/registration.cpp)."""

    def quant_matmul(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M, K] @ dequant(q [N, K]).T`` -> ``[M, N]`` in ``x``'s dtype."""
        ...

    def quant_matmul_dot(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M, K] bf16 @ dequant(q [N, K]).T`` -> bf16 ``[M, N]`` on AVX512-BF16 dot
        products, the weights as a dense bf16 copy holds them (groups of 32)."""
        ...

    def quant_matmul_q8(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M <= 8, K] @ dequant(q [N, K]).T`` -> ``[M, N]`` in ``x``'s dtype (fp32 or
        bf16), each row of ``x`` quantized to int8 per block of 32 (GGUF Q8_0) and multiplied
        on integer dot products (AVX2 ``vpmaddubsw``, AVX512-VNNI ``vpdpbusd``); groups of 32."""
        ...

    def quant_dot_supported(self) -> bool:
        """Whether ``quant_matmul_dot`` runs on this CPU (AVX512-BF16)."""
        ...

    def compiled_isa(self) -> list[str]:
        """The vector extensions the build was compiled with (``avx2``, ``fma``, ``f16c``,
        ``avx512f``, ``avx512bw``, ``avx512vnni``, ``avx512bf16``): which ``#if`` branches of
        the kernels it runs."""
        ...

    def quant_dequantize(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        dtype: torch.dtype,
        buffer: torch.Tensor | None,
        /,
    ) -> torch.Tensor:
        """The dense ``[N, K]`` weight in ``dtype``, written into ``buffer`` when given."""
        ...

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, /
    ) -> None:
        """``residual += x`` (when given), then ``x`` = RMSNorm of the sum (or of ``x``) times
        ``weight``, in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``[T, 2 * intermediate]`` projection."""
        ...

    def rotary_(
        self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int, /
    ) -> None:
        """Rotate-half rotary embedding of the first ``width`` columns of ``qk``, in place."""
        ...

    def argmax_rows(self, x: torch.Tensor, /) -> torch.Tensor:
        """``x.argmax(-1)`` of fp32 rows ``[rows, n]`` (first maximum; a NaN counts as the
        maximum), int64 ``[rows]``."""
        ...

    def apply_token_bitmask_(
        self, logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor, /
    ) -> torch.Tensor:
        """``-inf`` on ``logits[rows[i], t]`` (fp32 ``[R, V]``, in place) where bit ``t % 32`` of
        ``words[i, t // 32]`` (int32 ``[k, W]``) is 0 or ``t >= 32 W``; bool ``[k]``: whether
        each row kept a finite logit."""
        ...

    def layer_norm_(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, /
    ) -> None:
        """LayerNorm of bf16 rows ``x [T, D]`` with bf16 ``weight`` and ``bias`` ``[D]``, in
        place (statistics and the affine step in fp32, one rounding)."""
        ...

    def add_layer_norm_(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        /,
    ) -> None:
        """``layer_norm_`` of ``x + residual`` (added in fp32, not rounded), written over ``x``."""
        ...

    def int8_supported(self) -> bool:
        """Whether the int8 micro-kernels (AMX-INT8, AVX512-VNNI) give the right product here
        (checked once)."""
        ...

    def int8_pack(self, weight: torch.Tensor, /) -> list[torch.Tensor]:
        """``weight [N, K]`` as int8 per output channel: [packed, scales fp32 [N],
        column sums int32 [N]] (int8_linear.cpp)."""
        ...

    def int8_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        col_sums: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        gelu: bool,
        /,
    ) -> torch.Tensor:
        """w8a8 ``x [M, K] @ w.T + bias`` of bf16 rows quantized per row, then GELU (erf) or
        ``+ residual``, rounded once to bf16 ``[M, N]``."""
        ...

    def lora_shrink_expand(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a: list[torch.Tensor],
        b: list[torch.Tensor],
        row_starts: list[int],
        row_ends: list[int],
        col_starts: list[int],
        scales: list[float],
        /,
    ) -> None:
        """``out[r0:r1, c0:c0 + n] += scale * (x[r0:r1] @ a.T) @ b.T`` for every segment
        (``a [rank, K]``, ``b [n, rank]``, rows ``row_starts[s]:row_ends[s]``, first column
        ``col_starts[s]``), in place, in one call (lora.cpp); ``x`` / ``out`` fp32 or bf16, the
        factors fp32 or bf16, sums in fp32."""
        ...

    def DecodeStack(self, heads: int, kv_heads: int, head_dim: int, /) -> DecodeStack:  # noqa: N802
        """An empty stack of layers with these attention sizes (a torch custom class)."""
        ...


class DecodeStack(Protocol):
    """A llama-family decoder's layers with quantized weights, run as one C++ loop for decode
    steps (decode_stack.cpp): the ops of the model's layer loop (``LlamaModel.forward``) in
    the same order; built by cenote/runner/decode_stack.py."""

    def add_linear(
        self,
        q: torch.Tensor | None,
        scale: torch.Tensor | None,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        fused_max_rows: int,
        dot_max_rows: int,
        packed: torch.Tensor | None,
        dense_dtype: torch.dtype,
        bias: torch.Tensor | None,
        /,
    ) -> None:
        """The next projection of the layer being built (qkv, o, gate_up, down): quantized
        (``q``... up to ``fused_max_rows`` rows; bf16 rows up to ``dot_max_rows`` on bf16 dot
        products), oneDNN-prepacked dense (``packed`` in ``dense_dtype``: more rows, or a dense
        layer), or both."""
        ...

    def add_layer(
        self,
        post_norm: torch.Tensor,
        post_eps: float,
        next_norm: torch.Tensor,
        next_eps: float,
        scale: float,
        cache_index: int,
        /,
    ) -> None:
        """Close the layer: its post-attention norm, the next input norm (or the final one),
        the attention scale and which KV cache of the step is its own."""
        ...

    def num_layers(self) -> int: ...

    def run(
        self,
        residual: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        tables: list[torch.Tensor],
        starts: list[torch.Tensor],
        ends: list[torch.Tensor],
        lora_a: list[torch.Tensor],
        lora_b: list[torch.Tensor],
        lora_row_starts: list[int],
        lora_row_ends: list[int],
        lora_col_starts: list[int],
        lora_offsets: list[int],
        /,
    ) -> torch.Tensor:
        """Every layer over one-token rows: ``hidden`` is the first layer's normed input,
        ``residual`` its input (updated in place); returns the final norm's output. ``lora_*``:
        the step's LoRA segments over every projection in stack order, projection ``p``'s
        being ``lora_offsets[p]:lora_offsets[p + 1]`` (all empty: no adapter in the step)."""
        ...


class AttentionOps(Protocol):
    """The attention ops of ``torch.ops.cenote`` (their schemas: cenote/kernels/csrc/
    registration.cpp)."""

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        key_starts: torch.Tensor,
        key_ends: torch.Tensor,
        scale: float,
        softcap: float,
        /,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim] (fp32 or bf16, the cache's dtype); kv_cache: one layer's
        ``kv_cache_shape``; block_tables [rows, max_blocks] int64; row r attends to the keys at
        table positions [key_starts[r], key_ends[r]); softcap 0 = none; -> [rows, heads, dim]."""
        ...

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        scale: float,
        causal: bool,
        alibi_slopes: torch.Tensor | None = None,
        /,
    ) -> None:
        """q/out [tokens, heads, dim], k/v [tokens, kv_heads, dim]; the request of rows
        [starts[i], starts[i] + lengths[i]) attends to its own rows (SDPA, top-left causal when
        ``causal``), written into ``out``. ``alibi_slopes`` [heads] fp32 (bidirectional only):
        score(i, j) gains ``-slope * |i - j|`` before the softmax."""
        ...

    def varlen_micro_kernels(self) -> bool:
        """Whether bf16 ``varlen_attention`` runs on oneDNN's micro-kernels here (AMX or
        AVX512-BF16, checked once on a small product), not SDPA per request."""
        ...


class _LibraryOps:
    """The ``cenote`` library's ops as attributes (``ops.quant_matmul(...)``), each resolved
    once to its overload so a call costs one dispatch (about 2 us, measured), and its
    ``DecodeStack`` class (``torch.classes.cenote.DecodeStack``)."""

    def __getattr__(self, name: str) -> object:
        import torch

        if name == "DecodeStack":
            found: object = torch.classes.cenote.DecodeStack
        else:
            try:
                found = getattr(torch.ops.cenote, name).default
            except (AttributeError, RuntimeError) as e:  # no such op in the library
                raise AttributeError(f"the cenote kernel library has no op {name!r}") from e
        setattr(self, name, found)
        return found


_OPS = _LibraryOps()  # one instance: each op is resolved once per process, not once per call


def quant_ops() -> QuantOps | None:
    """The quantized-matmul / fused-layer ops of the kernel library (built on first call);
    None if unavailable. torch.ops carry no static types: QuantOps declares the schemas."""
    return cast(QuantOps, _OPS) if kernel_library() else None


@functools.cache
def attention_ops() -> AttentionOps | None:
    """The attention ops of the kernel library (built on first call), or None."""
    if not kernel_library():
        return None
    _register_fakes()
    return cast(AttentionOps, _OPS)


def _register_fakes() -> None:
    """Shape functions, so the ops can sit inside a traced or compiled graph."""
    import torch

    @torch.library.register_fake("cenote::paged_attention")  # type: ignore[untyped-decorator]
    def _paged(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake("cenote::varlen_attention")  # type: ignore[untyped-decorator]
    def _varlen(*args: object) -> None:
        return None
