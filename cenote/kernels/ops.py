"""One typed function per kernel op: what layers, the sampler and the loader call.

Each function decides by itself whether the C++ kernel takes its arguments (the library built,
host tensors, a dtype and layout the kernel reads) and otherwise runs its torch fallback, which
computes the same thing (bit for bit where docs/kernels.md says so). Callers never ask whether a
kernel exists. The library is resolved once per process, on the first call; after that a call
costs one global read before its own checks (a lookup per call cost 12 % of one-stream decode:
docs/performance.md).

``use_torch()`` runs every op on its fallback inside a block: tests compare the two paths and
benchmarks time them. Ops without a fallback (w8a8 packing and its matmul, the decode stack) raise
RuntimeError, or return None, where the library is absent; ``int8_supported()`` and
``kernels_built()`` let the loader refuse such options up front.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cenote.kernels.library import attention_ops, quant_ops

if TYPE_CHECKING:
    from cenote.kernels.library import AttentionOps, DecodeStack, QuantOps

_ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the row kernels read and write
_lock = threading.Lock()
_resolved = False  # set once the first call has loaded (or failed to load) the library
_library: QuantOps | None = None
_attention: AttentionOps | None = None


def _kernels() -> QuantOps | None:
    """The library's ops, or None (torch fallbacks); loaded on the first call."""
    if not _resolved:
        _resolve()
    return _library


def _attention_kernels() -> AttentionOps | None:
    if not _resolved:
        _resolve()
    return _attention


def _resolve() -> None:
    global _resolved, _library, _attention
    with _lock:
        if not _resolved:
            _library, _attention = quant_ops(), attention_ops()
            _resolved = True


def load() -> None:
    """Build or load the library now (with the model), not on its first request."""
    _kernels()


def kernels_built() -> bool:
    """Whether the C++ library is in use (built or loaded; not disabled, not ``use_torch``)."""
    return _kernels() is not None


@contextlib.contextmanager
def use_torch() -> Iterator[None]:
    """Every op runs its torch fallback inside the block (process-wide; for tests and
    benchmarks, not for serving)."""
    global _library, _attention
    _kernels()
    saved = _library, _attention
    _library = _attention = None
    try:
        yield
    finally:
        _library, _attention = saved


def _host_rows(x: torch.Tensor) -> bool:
    """2-d fp32/bf16 host rows with unit column stride: what the row kernels take."""
    return x.device.type == "cpu" and x.dtype in _ROW_DTYPES and x.dim() == 2 and x.stride(1) == 1


# ---- decoder-layer elementwise steps (csrc/fused_ops.cpp) ---------------------------------------


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> None:
    """``residual += x`` (when given), then ``x`` = RMSNorm of the sum (or of ``x``) times
    ``weight``, in place; rounds as Hugging Face Llama (fp32 statistics, cast, then scale)."""
    kernels = _kernels()
    if kernels is not None and _host_rows(x) and x.is_contiguous() and weight.dtype == x.dtype:
        if residual is None or residual.is_contiguous():
            kernels.add_rms_norm_(x, residual, weight, eps)
            return
    if residual is not None:
        residual.add_(x)
    source = x if residual is None else residual
    h = source.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    x.copy_(weight * normed.to(x.dtype))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[T, 2 * intermediate]`` projection, each step rounded
    to the dtype as torch does."""
    kernels = _kernels()
    if kernels is not None and _host_rows(gate_up) and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> None:
    """Rotate-half rotary embedding of the first ``width`` columns of ``qk [T, >= width]`` (heads
    of ``cos.shape[1]`` columns side by side), in place: ``x * cos + rotate_half(x) * sin``."""
    kernels = _kernels()
    if (
        kernels is not None
        and _host_rows(qk)
        and cos.dtype == qk.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        kernels.rotary_(qk, cos, sin, width)
        return
    head_dim = cos.shape[-1]
    heads = qk[:, :width].view(qk.shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    cos, sin = cos.to(qk.dtype).unsqueeze(1), sin.to(qk.dtype).unsqueeze(1)
    qk[:, :width] = (heads * cos + rotated * sin).reshape(qk.shape[0], width)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first maximum, a NaN counting as the maximum (torch's answer)."""
    kernels = _kernels()
    if (
        kernels is not None
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[1]
    ):
        return kernels.argmax_rows(x if x.stride(1) == 1 else x.contiguous())
    return x.argmax(dim=-1)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_(
    logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor
) -> torch.Tensor:
    """``-inf`` on ``logits[rows[i], t]`` (fp32 ``[R, V]``, in place) where bit ``t % 32`` of
    ``words[i, t // 32]`` (int32 ``[k, W]``) is 0 or ``t >= 32 W``; bool ``[k]``: whether each
    row kept a finite logit."""
    kernels = _kernels()
    if (
        kernels is not None
        and logits.dtype == torch.float32
        and logits.stride(-1) == 1
        and logits.device.type == "cpu"
    ):
        return kernels.apply_token_bitmask_(logits, rows, words.contiguous())
    vocab = logits.shape[1]
    words = words.to(logits.device)
    allowed = ((words.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:  # ids past the bitmask are refused
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = rows.to(logits.device)
    picked = logits.index_select(0, index).masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, picked)
    return torch.isfinite(picked).any(dim=1)


def _layer_norm_kernel_takes(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    return (
        x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.stride(1) == 1
        and x.device.type == "cpu"
        and weight is not None
        and bias is not None
        and weight.dtype == torch.bfloat16
        and bias.dtype == torch.bfloat16
        and not torch.is_grad_enabled()
    )


def layer_norm_(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of rows ``x [T, D]`` over the last dimension, written over ``x`` where the kernel
    takes it (2-d bf16 host rows: statistics and the affine step in fp32, one rounding; the
    moments' summation order differs from torch's, so a value can differ by one bf16 step);
    returns the result (``x`` itself, or a new tensor)."""
    kernels = _kernels()
    if kernels is not None and _layer_norm_kernel_takes(x, weight, bias):
        assert weight is not None and bias is not None  # checked above
        kernels.layer_norm_(x, weight, bias, eps)
        return x
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def add_layer_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """LayerNorm of ``x + residual``, written over ``x`` where the kernel takes it (the sum then
    stays in fp32, not rounded); returns the result."""
    kernels = _kernels()
    if (
        kernels is not None
        and _layer_norm_kernel_takes(x, weight, bias)
        and _layer_norm_kernel_takes(residual, weight, bias)
        and residual.shape == x.shape
    ):
        assert weight is not None and bias is not None  # checked above
        kernels.add_layer_norm_(x, residual, weight, bias, eps)
        return x
    return layer_norm_(x.add_(residual), weight, bias, eps)


def layer_norm_in_place(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether ``layer_norm_`` of ``x`` runs on the kernel (a fusion choice of the caller's)."""
    return _kernels() is not None and _layer_norm_kernel_takes(x, weight, bias)


# ---- weight-only quantized matmuls (csrc/quant_linear.cpp, q8_linear.cpp) -----------------------


def dequantize_reference(
    q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """fp32 ``[N, K]`` of a ``w4`` / ``w8`` weight (cenote/models/layers/quant.py) in torch."""
    n = q.shape[0]
    k = q.shape[1] * (2 if bits == 4 else 1)
    if bits == 4:
        packed = q.view(n, k // 32, 16)
        values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # [n, groups, 32]
    else:
        values = q.view(n, k // group, group).float()
    values = values * scale.float().unsqueeze(-1)
    if mn is not None:
        values = values + mn.float().unsqueeze(-1)
    return values.reshape(n, k)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
    buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype`` (into ``buffer``, when given, on the kernel);
    every value equals ``dequantize_reference``'s."""
    kernels = _kernels()
    if kernels is not None and dtype in _ROW_DTYPES and q.device.type == "cpu":
        return kernels.quant_dequantize(q, scale, mn, bits, group, dtype, buffer)
    return dequantize_reference(q, scale, mn, bits, group).to(dtype)


def quant_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor | None,
    bits: int,
    group: int,
) -> torch.Tensor:
    """``x [M, K] @ dequant(q).T`` -> ``[M, N]`` in ``x``'s dtype: groups expanded to fp32 inside
    the dot products (the kernel, for few rows), else dequantize + one matmul."""
    kernels = _kernels()
    if kernels is not None and x.device.type == "cpu":
        native = x.dtype in _ROW_DTYPES  # the kernel's own in/out dtypes
        out = kernels.quant_matmul(
            (x if native else x.float()).contiguous(), q, scale, mn, bits, group
        )
        return out if native else out.to(x.dtype)
    return torch.mm(x, dequantize(q, scale, mn, bits, group, x.dtype).t())


def quant_dot_supported() -> bool:
    """Whether ``quant_matmul_dot`` runs its kernel here (AVX512-BF16)."""
    kernels = _kernels()
    return kernels is not None and kernels.quant_dot_supported()


def quant_matmul_dot(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor | None,
    bits: int,
    group: int,
) -> torch.Tensor:
    """``x [M, K] bf16 @ dequant(q).T`` -> bf16 ``[M, N]``, the weights as a dense bf16 copy holds
    them (AVX512-BF16 dot products; else a matmul of that copy)."""
    kernels = _kernels()
    if kernels is not None and x.device.type == "cpu" and kernels.quant_dot_supported():
        return kernels.quant_matmul_dot(x.contiguous(), q, scale, mn, bits, group)
    return torch.mm(x, dequantize(q, scale, mn, bits, group, torch.bfloat16).t())


def quant_matmul_q8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor | None,
    bits: int,
    group: int,
) -> torch.Tensor:
    """``x [M <= 8, K] @ dequant(q).T`` with each row of ``x`` quantized to int8 per block of 32
    (GGUF Q8_0, half away from zero) -> ``[M, N]`` in ``x``'s dtype (fp32 or bf16)."""
    kernels = _kernels()
    if kernels is not None and x.device.type == "cpu":
        return kernels.quant_matmul_q8(x, q, scale, mn, bits, group)
    blocks = x.float().view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    v = blocks * torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.sign(v) * torch.floor(v.abs() + 0.5)
    rows = (xq * dx).view(x.shape[0], -1)
    return torch.mm(rows, dequantize_reference(q, scale, mn, bits, group).t()).to(x.dtype)


# ---- w8a8 (csrc/int8_linear.cpp): no fallback ----------------------------------------------------


def int8_supported() -> bool:
    """Whether the int8 micro-kernels (AMX-INT8, AVX512-VNNI) give the right product here."""
    kernels = _kernels()
    return kernels is not None and kernels.int8_supported()


def _int8_kernels() -> QuantOps:
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("w8a8 needs the C++ kernels, which did not build (see the log)")
    return kernels


def int8_pack(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight [N, K]`` as int8 per output channel: [packed, scales fp32 [N], column sums int32
    [N]]. Raises RuntimeError without the kernels."""
    return _int8_kernels().int8_pack(weight)


def int8_linear(
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    gelu: bool,
) -> torch.Tensor | None:
    """w8a8 ``x [M, K] @ w.T + bias`` of bf16 rows quantized per row, then GELU (erf) or
    ``+ residual``, rounded once to bf16; None where the kernel does not take these tensors
    (the caller multiplies its dense weight)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.device.type != "cpu":
        return None
    if residual is not None and (residual.dtype != torch.bfloat16 or residual.stride(1) != 1):
        return None
    if bias is not None and bias.dtype != torch.bfloat16:
        return None
    return _int8_kernels().int8_linear(x, *packed, bias, residual, gelu)


# ---- LoRA (csrc/lora.cpp) ----------------------------------------------------------------------


def lora_shrink_expand(
    out: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    row_starts: list[int],
    row_ends: list[int],
    col_starts: list[int],
    scales: list[float],
) -> None:
    """``out[r0:r1, c0:c0 + n] += scale * (x[r0:r1] @ a.T) @ b.T`` for every segment (one
    adapter's run of rows times one block of output columns), in place. The kernel sums in fp32
    and rounds each output once; the fallback does the same per segment in torch."""
    kernels = _kernels()
    if (
        kernels is not None
        and _host_rows(x)
        and out.device.type == "cpu"
        and x.is_contiguous()
        and out.is_contiguous()
    ):
        kernels.lora_shrink_expand(out, x, a, b, row_starts, row_ends, col_starts, scales)
        return
    for a_s, b_s, r0, r1, c0, scale in zip(
        a, b, row_starts, row_ends, col_starts, scales, strict=True
    ):
        update = (x[r0:r1].float() @ a_s.float().t()) @ b_s.float().t()
        target = out[r0:r1, c0 : c0 + b_s.shape[0]]
        target.copy_((target.float() + scale * update).to(out.dtype))


# ---- attention (csrc/paged_attention.cpp, varlen_attention.cpp) ---------------------------------


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[2, kv_heads, batch, num_blocks * block_size, dim] keys and values of ``blocks``
    ([batch, num_blocks] or [num_blocks]) of one layer's cache, one index_select for both."""
    two, heads, num_blocks, block_size, dim = kv_cache.shape
    batch = blocks.shape[0] if blocks.dim() == 2 else 1
    flat = kv_cache.view(two * heads, num_blocks, block_size * dim)
    picked = flat.index_select(1, blocks.reshape(-1))
    return picked.view(two, heads, batch, -1, dim)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    key_starts: torch.Tensor,
    key_ends: torch.Tensor,
    scale: float,
    softcap: float | None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-token queries ``q [rows, heads, dim]`` over one layer's paged cache: row r attends to
    the keys at table positions ``[key_starts[r], key_ends[r])`` of ``block_tables [rows,
    max_blocks]``; ``softcap`` None = none; ``key_padding [rows, max_blocks * block_size]``
    bool (True: not a key of the row), when the caller has it; -> ``[rows, heads, dim]``. The kernel reads the
    blocks in place; the fallback gathers the padded tables (two batched matmuls: measured 4x
    faster than SDPA for bf16 one-token queries)."""
    kernels = _attention_kernels()
    if (
        kernels is not None
        and q.device.type == "cpu"
        and q.dtype in _ROW_DTYPES
        and q.dtype == kv_cache.dtype
    ):
        head_dim = q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        return kernels.paged_attention(
            q, kv_cache, block_tables, key_starts, key_ends, scale, softcap or 0.0
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    kv = gather_blocks(kv_cache, block_tables)  # [2, kv_heads, batch, L, dim]
    length = kv.shape[3]
    keys = kv[0].view(num_kv_heads * batch, length, head_dim)
    values = kv[1].view(num_kv_heads * batch, length, head_dim)
    # [batch, heads, dim] -> [kv_heads * batch, group, dim]
    query = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).to(keys.dtype)
    query = query.reshape(num_kv_heads * batch, group, head_dim)
    scores = torch.bmm(query, keys.transpose(1, 2)).float()  # [kv_heads * batch, group, L]
    scores = scores.view(num_kv_heads, batch, group, length).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    if key_padding is None:
        positions = torch.arange(length, device=q.device).unsqueeze(0)
        key_padding = (positions < key_starts.unsqueeze(1)) | (positions >= key_ends.unsqueeze(1))
    scores.masked_fill_(key_padding[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs.view(-1, group, length), values)  # [kv_heads * batch, group, dim]
    out = out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """``q``/``out [tokens, heads, dim]``, ``k``/``v [tokens, kv_heads, dim]``: the request of
    rows ``[starts[i], starts[i] + lengths[i])`` attends to its own rows (top-left causal when
    ``causal``; ``alibi_slopes [heads]``: score(i, j) gains ``-slope * |i - j|``), written into
    ``out``. The kernel takes every request in one call; the fallback one SDPA call per run of
    adjacent equal-length requests."""
    kernels = _attention_kernels()
    if kernels is not None and q.device.type == "cpu":
        kernels.varlen_attention(q, k, v, out, starts, lengths, scale, causal, alibi_slopes)
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    i = 0
    while i < len(lengths):
        n, j = lengths[i], i
        while j + 1 < len(lengths) and lengths[j + 1] == n and starts[j + 1] == starts[j] + n:
            j += 1
        rows = slice(starts[i], starts[j] + n)
        count = j - i + 1
        mask = None
        if alibi_slopes is not None:
            positions = torch.arange(n, dtype=torch.float32)
            distance = (positions.unsqueeze(0) - positions.unsqueeze(1)).abs()  # [n, n]
            mask = (distance * -alibi_slopes.view(-1, 1, 1)).to(q.dtype).to(q.device)
        result = F.scaled_dot_product_attention(
            q[rows].view(count, n, num_heads, head_dim).transpose(1, 2),
            k[rows].view(count, n, num_kv_heads, head_dim).transpose(1, 2),
            v[rows].view(count, n, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scale,
            enable_gqa=num_kv_heads != num_heads,
        )
        out[rows] = result.transpose(1, 2).reshape(rows.stop - rows.start, num_heads, head_dim)
        i = j + 1


def varlen_micro_kernels() -> bool:
    """Whether bf16 ``varlen_attention`` runs on oneDNN's micro-kernels here (AMX or
    AVX512-BF16), not SDPA per request."""
    kernels = _attention_kernels()
    return kernels is not None and kernels.varlen_micro_kernels()


# ---- the decode stack (csrc/decode_stack.cpp) ----------------------------------------------------


def decode_stack(num_heads: int, num_kv_heads: int, head_dim: int) -> DecodeStack | None:
    """An empty C++ decode stack with these attention sizes, or None without the kernels (the
    model's layer loop runs then)."""
    kernels = _kernels()
    if kernels is None or _attention_kernels() is None:
        return None
    return kernels.DecodeStack(num_heads, num_kv_heads, head_dim)


def compiled_isa() -> list[str]:
    """The vector extensions the build was compiled with ([] without one)."""
    kernels = _kernels()
    return [] if kernels is None else kernels.compiled_isa()
