"""Quantized embeddings with sentence-transformers' ``quantize_embeddings`` semantics.

int8 / uint8: per-dimension ranges ``[2, dim]`` (min row, max row), given as ``ranges``, or
taken from ``calibration_embeddings``, or else from the batch itself (so a row's result then
depends on the rows beside it); 255 equal steps from min, floored and clipped to 0..255
(int8: minus 128). binary / ubinary: the sign bits (value > 0) packed 8 to a byte, first
dimension in the high bit (binary: the byte minus 128, as int8)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from cenote.errors import InvalidInputError

Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[Precision, ...] = ("float32", "int8", "uint8", "binary", "ubinary")


def quantization_ranges(embeddings: np.ndarray) -> np.ndarray:
    """The per-dimension ``[min, max]`` rows of ``embeddings`` (``[num, dim]``, num >= 2)."""
    if embeddings.ndim == 1 or embeddings.shape[0] < 2:
        raise InvalidInputError(
            "int8 / uint8 ranges cannot come from a single embedding; pass ranges or "
            "calibration_embeddings from a representative set"
        )
    return np.vstack((embeddings.min(axis=0), embeddings.max(axis=0)))


def quantize_embeddings(
    embeddings: np.ndarray | torch.Tensor | list[list[float]],
    precision: Precision,
    ranges: np.ndarray | None = None,
    calibration_embeddings: np.ndarray | None = None,
) -> np.ndarray:
    """``embeddings`` (``[num, dim]`` or ``[dim]``, float) at ``precision``."""
    if precision not in PRECISIONS:
        raise InvalidInputError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if isinstance(embeddings, torch.Tensor):
        array = embeddings.detach().cpu().float().numpy()
    else:
        array = np.asarray(embeddings)
    if array.dtype in (np.int8, np.uint8):
        raise InvalidInputError("embeddings to quantize must be float, not int8 or uint8")
    if precision == "float32":
        return array.astype(np.float32)
    if precision in ("int8", "uint8"):
        if ranges is None:
            source = array if calibration_embeddings is None else calibration_embeddings
            ranges = quantization_ranges(np.asarray(source))
        ranges = np.asarray(ranges).astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((array - starts) / steps), 0, 255)
        result: np.ndarray = (
            buckets.astype(np.uint8) if precision == "uint8" else ((buckets - 128).astype(np.int8))
        )
        return result
    packed = np.packbits(array > 0, axis=-1)  # uint8
    if precision == "ubinary":
        return packed
    return (packed.astype(np.int16) - 128).astype(np.int8)
