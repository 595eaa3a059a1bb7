"""Weight-only quantized linear layers: 4 or 8 bits plus per-group scales, kept that way in memory.

A GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensors are converted exactly (every value the
kernel reconstructs equals the one ``gguf.quants.dequantize`` gives) into two layouts:

- ``w4``: uint8 ``[N, K / 2]`` nibbles, groups of 32, ``value = scale * q + min``;
- ``w8``: int8 ``[N, K]``, groups of 16 or 32, ``value = scale * q (+ min)``.

A safetensors model opts in with ``quantization="int8"`` (symmetric, groups of 32) or ``"int4"``
(asymmetric, groups of 32). The matmul (cenote/kernels/quant_linear.cpp) expands each group to
fp32 inside the dot products when few rows are multiplied (decode: bound by the weight bytes
read), and dequantizes to the activation dtype for one BLAS matmul when many are (prefill,
embeddings: bound by FLOPs).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cenote.kernels import ops
from cenote.models.layers.linear import pack_weight, packed_linear
from cenote.models.layers.lora import LoRAHost

logger = logging.getLogger(__name__)

# Rows at or below which the fused kernel beats dequantize + BLAS matmul (measured with
# benchmarks/quant_matmul.py; see there for the numbers on each CPU kind).
FUSED_MAX_ROWS = 8
# Rows above which a layer's dense copy (``QuantLinear.keep_dense``) beats the fused kernel, by
# the copy's dtype (end-to-end decode of SmolLM2 Q4_1 at 3 to 16 streams, Intel AMX machine): a
# bf16 copy multiplies on AMX and wins from 5 rows; an fp32 one only from about 12 rows.
DENSE_ABOVE_ROWS = {torch.bfloat16: 4, torch.float32: FUSED_MAX_ROWS}
# bf16 activations meet a 4-bit or 8-bit weight (groups of 32) on AVX512-BF16 dot products
# (``quant_matmul_dot``: each group dequantized once per call into a register, as a dense bf16
# copy would hold it) for steps of more than DENSE_ABOVE_ROWS[bf16] rows, up to DOT_MAX_ROWS;
# with a dense copy kept, only up to DOT_MAX_ROWS_WITH_COPY. Measured with
# benchmarks/experiments/dot_matmul.py (AMD EPYC Zen 4, SmolLM2's four projections, us a layer, dot / dense
# bf16 copy / dequantize + matmul): 16 rows 580 / 725 / 1029, 32 rows 937 / 1096 / 1448,
# 64 rows 1598 / 1499 / 1985, 128 rows 2462 / 2489 / 2841, 192 rows 4021 / 3764 / 4178.
DOT_MAX_ROWS = 128
DOT_MAX_ROWS_WITH_COPY = 32


@dataclass
class QuantizedWeight:
    """A ``[N, K]`` weight in the ``w4`` or ``w8`` layout (see the module docstring)."""

    qdata: torch.Tensor  # uint8 [N, K/2] (4 bits) or int8 [N, K] (8 bits)
    scales: torch.Tensor  # [N, K / group], fp16 or fp32
    mins: torch.Tensor | None  # like scales, or None (symmetric)
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        k = self.qdata.shape[1] * (2 if self.bits == 4 else 1)
        return (self.qdata.shape[0], k)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.qdata.nbytes + self.scales.nbytes + extra

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The rows ``index`` (a permutation, a slice) as their own weight."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(
            self.qdata[index].contiguous(),
            self.scales[index].contiguous(),
            mins,
            self.bits,
            self.group,
        )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, workspace: bool = False
    ) -> torch.Tensor:
        """The dense ``[N, K]`` weight. With ``workspace`` it is written into a buffer shared by
        every layer (valid until the next such call on this thread): the matmul that follows
        reads it at once, and a fresh multi-MB tensor per call costs more in page faults than
        the dequantization itself (measured 3x)."""
        in_buffer = workspace and dtype in (torch.float32, torch.bfloat16)  # the kernel's dtypes
        buffer = _workspace(dtype, self.shape[0] * self.shape[1]) if in_buffer else None
        return ops.dequantize(
            self.qdata, self.scales, self.mins, self.bits, self.group, dtype, buffer
        )


_workspaces = threading.local()


def _workspace(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """This thread's reusable buffer of at least ``numel`` elements of ``dtype``."""
    buffers = _workspaces.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight of ``parts`` stacked by rows, or None where their formats differ."""
    first = parts[0]
    same = all(
        (p.bits, p.group, p.scales.dtype, p.mins is None, p.shape[1])
        == (first.bits, first.group, first.scales.dtype, first.mins is None, first.shape[1])
        for p in parts
    )
    if not same:
        return None
    mins_parts = [p.mins for p in parts if p.mins is not None]  # all or none (``same``)
    mins = torch.cat(mins_parts) if mins_parts else None
    return QuantizedWeight(
        torch.cat([p.qdata for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
        first.bits,
        first.group,
    )


def dequantize_reference(weight: QuantizedWeight) -> torch.Tensor:
    """fp32 ``[N, K]`` in plain torch (the kernel's reference, and its fallback)."""
    return ops.dequantize_reference(
        weight.qdata, weight.scales, weight.mins, weight.bits, weight.group
    )


def pack_w4(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 ``[N, K]`` -> ``[N, K/2]`` bytes: per group of 32, byte j holds
    element j (low nibble) and element j + 16 (high nibble)."""
    n, k = q.shape
    groups = q.reshape(n, k // 32, 2, 16).astype(np.uint8)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2)


# ---- GGUF ---------------------------------------------------------------------------------------


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)


def _f16(block_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block_bytes).view(np.float16)[..., 0]


def _packed(
    qdata: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int, group: int
) -> QuantizedWeight:
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(qdata)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
        bits,
        group,
    )


def _from_grid(
    values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int, group: int
) -> QuantizedWeight:
    """Recover the integers of exactly quantized ``values [N, K]`` (``scale * q + min``, with
    per-group ``scales``/``mins [N, K/group]``) and pack them."""
    n, k = values.shape
    grid = values.reshape(n, k // group, group)
    if mins is not None:
        grid = grid - mins[..., None].astype(np.float32)
    scale = scales[..., None].astype(np.float32)
    q = np.rint(grid / np.where(scale == 0, np.float32(1), scale)).reshape(n, k)
    packed = pack_w4(q.astype(np.uint8)) if bits == 4 else q.astype(np.int8)
    return _packed(packed, scales, mins, bits, group)


def from_gguf(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantizedWeight | None:
    """``QuantizedWeight`` of a GGUF tensor's raw blocks (``ReaderTensor.data``) of type ``qtype``
    and Hugging Face ``shape`` [N, K], or None for a type kept dense (F32, F16, ...)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import Q4_K, dequantize

    rows, k = shape
    kind = GGMLQuantizationType[qtype]
    mins: np.ndarray | None  # per-group offsets, None where the type has none

    def dense() -> np.ndarray:
        return np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, k)

    if qtype in ("Q4_0", "Q4_1", "Q8_0"):  # the file's bytes are already our layout
        block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
        blocks = _blocks(data, rows, block_bytes)
        d = _f16(blocks[..., 0:2])  # [N, K/32]
        if qtype == "Q8_0":
            qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, k)
            return _packed(qs, d, None, 8, 32)
        if qtype == "Q4_1":
            mins, start = _f16(blocks[..., 2:4]), 4
        else:  # Q4_0: value = d * (q - 8) = d * q + (-8 d), exact in fp16
            mins, start = (d.astype(np.float32) * -8).astype(np.float16), 2
        qs = np.ascontiguousarray(blocks[..., start:]).reshape(rows, k // 2)
        return _packed(qs, d, mins, 4, 32)
    if qtype in ("Q5_0", "Q5_1"):
        blocks = _blocks(data, rows, 22 if qtype == "Q5_0" else 24)
        d = _f16(blocks[..., 0:2])
        mins = _f16(blocks[..., 2:4]) if qtype == "Q5_1" else None
        return _from_grid(dense(), d, mins, 8, 32)  # Q5_0: q - 16 in int8, no min
    if qtype in ("Q4_K", "Q5_K"):
        block_bytes = {"Q4_K": 144, "Q5_K": 176}[qtype]
        blocks = _blocks(data, rows, block_bytes).reshape(-1, block_bytes)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [blocks, 8] each
        scales = (d * sc.astype(np.float32)).reshape(rows, k // 32)
        mins = -(dmin * m.astype(np.float32)).reshape(rows, k // 32)
        return _from_grid(dense(), scales, mins, 4 if qtype == "Q4_K" else 8, 32)
    if qtype == "Q6_K":
        blocks = _blocks(data, rows, 210).reshape(-1, 210)
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [blocks, 16]
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        scales = (d * sc).reshape(rows, k // 16)
        return _from_grid(dense(), scales, None, 8, 16)
    return None


# ---- safetensors opt-in -------------------------------------------------------------------------


def quantize_dense(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """Weight-only quantization of a dense ``[N, K]`` weight: ``int8`` (symmetric, groups of
    32, round to nearest) or ``int4`` (asymmetric min/max, groups of 32)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % 32:
        raise ValueError(f"{method} quantization needs in_features divisible by 32, got {k}")
    groups = w.view(n, k // 32, 32)
    if method == "int8":
        scale = groups.abs().amax(-1) / 127
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(groups / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.view(n, k), scale.contiguous(), None, 8, 32)
    if method == "int4":
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15)
        packed = pack_w4(q.to(torch.uint8).view(n, k).numpy())
        return QuantizedWeight(
            torch.from_numpy(packed), scale.contiguous(), low.contiguous(), 4, 32
        )
    raise ValueError(f"unknown quantization {method!r}; choose int8 or int4")


# ---- modules ------------------------------------------------------------------------------------


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` in ``x``'s dtype."""
    if x.shape[0] <= FUSED_MAX_ROWS:
        out = ops.quant_matmul(
            x, weight.qdata, weight.scales, weight.mins, weight.bits, weight.group
        )
    else:
        out = torch.mm(x, weight.dequantize(x.dtype, workspace=True).t())
    return out if bias is None else out + bias


class QuantLinear(LoRAHost, nn.Module):
    """A linear layer whose weight is one or more row blocks of ``QuantizedWeight``s (fused
    projections whose shards came in different formats keep one block each). LoRA adapters
    stay dense beside it and add their updates after the quantized matmul (``LoRAHost``)."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.init_lora()
        merged = parts[0] if len(parts) == 1 else cat_rows(parts)
        self.parts = [merged] if merged is not None else parts
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # a dense copy for steps of many rows (``keep_dense``): prepacked, else plain
        self._dense: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._dense_above_rows = FUSED_MAX_ROWS
        self._dot = False  # bf16 dot products (use_dot_products)

    def keep_dense(self, dtype: torch.dtype) -> int:
        """Also keep the weight dense in ``dtype`` (oneDNN-prepacked where possible) for steps
        of more than ``DENSE_ABOVE_ROWS[dtype]`` rows, which then skip the fused kernel or the
        per-step dequantization; returns the bytes the copy takes."""
        weight = torch.cat([part.dequantize(dtype) for part in self.parts])
        packed = pack_weight(weight)
        # the prepacked copy is all the matmul reads: the plain one is only a dtype/shape tag
        self._dense = (weight if packed is None else weight.new_empty(0, weight.shape[1]), packed)
        self._dense_above_rows = DENSE_ABOVE_ROWS.get(dtype, FUSED_MAX_ROWS)
        return weight.nbytes

    def use_dot_products(self) -> bool:
        """Multiply bf16 steps of more than DENSE_ABOVE_ROWS[bf16] rows, up to DOT_MAX_ROWS,
        with ``quant_matmul_dot``, where it runs here and takes this layer's layout; returns
        whether it does."""
        if not ops.quant_dot_supported() or len(self.parts) != 1:
            return False
        if self.parts[0].group != 32:
            return False
        self._dot = True
        self._dense_above_rows = DENSE_ABOVE_ROWS[torch.bfloat16]
        return True

    @property
    def dot_max_rows(self) -> int:
        """The most bf16 rows ``quant_matmul_dot`` multiplies for this layer (above
        ``fused_max_rows``; 0: none). Beside a dense copy only a 4-bit weight takes it, up to
        DOT_MAX_ROWS_WITH_COPY: for 8-bit weights the copy is as fast at 8-16 rows and faster
        from 32 (benchmarks/experiments/dot_matmul.py --bits 8)."""
        if not self._dot:
            return 0
        if self._dense is None:
            return DOT_MAX_ROWS
        return DOT_MAX_ROWS_WITH_COPY if self.parts[0].bits == 4 else 0

    @property
    def dense_packed(self) -> torch.Tensor | None:
        """The oneDNN-prepacked dense copy (``keep_dense``), or None."""
        return None if self._dense is None else self._dense[1]

    @property
    def dense_dtype(self) -> torch.dtype | None:
        return None if self._dense is None else self._dense[0].dtype

    @property
    def fused_max_rows(self) -> int:
        """The most rows this layer multiplies with the fused kernel (more: the dense copy, or
        dequantize + matmul)."""
        return self._dense_above_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self._base_forward(x))

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._dense_above_rows < rows <= self.dot_max_rows and x.dtype == torch.bfloat16:
            part = self.parts[0]
            out = ops.quant_matmul_dot(x, part.qdata, part.scales, part.mins, part.bits, part.group)
            return out if self.bias is None else out + self.bias
        if self._dense is not None and rows > self._dense_above_rows:
            weight, packed = self._dense
            bias = None if self.bias is None else self.bias.to(weight.dtype)
            return packed_linear(x.to(weight.dtype), weight, packed, bias).to(x.dtype)
        if len(self.parts) == 1:
            return quant_linear(x, self.parts[0], self.bias)
        out = torch.cat([quant_linear(x, part, None) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        formats = ", ".join(f"w{p.bits}g{p.group}" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {formats}"


class QuantEmbedding(nn.Module):
    """Token embeddings whose table stays quantized: rows are dequantized when looked up."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.rows(ids.reshape(-1))
        return dequantize_reference(rows).to(self.dtype).view(*ids.shape, self.embedding_dim)


def quantize_trunk(model: nn.Module, method: str) -> int:
    """Replace every ``TrunkLinear`` of ``model`` by a ``QuantLinear`` of its weight quantized
    with ``method`` (int8 / int4); returns how many were replaced."""
    from cenote.models.layers.linear import TrunkLinear

    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, TrunkLinear)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = quantize_dense(module.weight, method)
        setattr(parent, child, QuantLinear([weight], module.bias))
    return len(targets)


def use_dot_products(model: nn.Module, dtype: torch.dtype) -> int:
    """In a bf16 model, every ``QuantLinear`` that can multiplies steps of a few to
    DOT_MAX_ROWS rows on bf16 dot products (``QuantLinear.use_dot_products``); returns how many
    layers do, of how many."""
    if dtype != torch.bfloat16:
        return 0
    return sum(m.use_dot_products() for m in model.modules() if isinstance(m, QuantLinear))


def keep_dense_copies(model: nn.Module, dtype: torch.dtype, mode: str) -> int:
    """Give every ``QuantLinear`` of ``model`` a dense copy in ``dtype`` (``keep_dense``) when
    ``mode`` is "on", or "auto" and the copies take at most a quarter of the memory available
    now; returns the bytes added (0: none kept). Layers with bf16 dot products
    (``use_dot_products``) still take them up to DOT_MAX_ROWS_WITH_COPY rows with a copy, and
    up to DOT_MAX_ROWS without one."""
    layers = [module for module in model.modules() if isinstance(module, QuantLinear)]
    need = sum(layer.in_features * layer.out_features for layer in layers) * dtype.itemsize
    if mode == "off" or not layers:
        return 0
    available = available_memory()
    if mode == "auto" and available is not None and need > available // 4:
        logger.info(
            "no dense copy of the quantized weights: %d MiB would exceed a quarter of the "
            "%d MiB available (steps of more than %d rows dequantize instead)",
            need >> 20,
            available >> 20,
            max([FUSED_MAX_ROWS] + [layer.dot_max_rows for layer in layers]),
        )
        return 0
    for layer in layers:
        layer.keep_dense(dtype)
    logger.info(
        "kept a %s copy of %d quantized layers (%d MiB) for steps of more rows than the fused "
        "kernel (%d) or bf16 dot products (%d) take",
        str(dtype).removeprefix("torch."),
        len(layers),
        need >> 20,
        DENSE_ABOVE_ROWS.get(dtype, FUSED_MAX_ROWS),
        max(layer.dot_max_rows for layer in layers),
    )
    return need


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
