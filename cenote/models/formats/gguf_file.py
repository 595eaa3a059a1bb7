"""A GGUF file's metadata and tensor index, read in one pass over its header.

gguf's ``GGUFReader`` builds a numpy view for every part of every metadata value: for
SmolLM2-135M's 49,152-token vocabulary and 48,900 merges that is about a million views and
seconds (docs/performance.md), paid twice by ``cenote serve`` (the front end reads the file's
config and tokenizer, the engine core re-opens it for the tensors). This reader decodes the same
header (GGUF versions 2 and 3, little-endian, as the gguf package writes it) with ``struct`` and
``numpy.frombuffer``, some thirty times faster. It keeps gguf's own types: the tensors are gguf
``ReaderTensor``s whose ``data`` is a view of one read-only memory map, shaped as ``GGUFReader``
shapes it, and the quantization tables (``GGML_QUANT_SIZES``) are gguf's.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderField, ReaderTensor
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

_SCALARS: dict[int, tuple[str, int]] = {  # value type -> (struct format, size)
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_ARRAY_DTYPES: dict[int, str] = {  # numeric arrays are read whole
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {  # unquantized tensor types
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into a checkpoint (unknown architecture, tokenizer, ...)."""


class GGUFFormatError(GGUFError):
    """The file is not a GGUF this reader can read (the message says where and why)."""


class _Cursor:
    """Reads little-endian values from the header, failing with the offset on a short file."""

    def __init__(self, data: np.ndarray[Any, np.dtype[np.uint8]], path: Path) -> None:
        self.buffer = data.data  # a memoryview of the mapped bytes
        self.pos = 0
        self.path = path

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if size < 0 or end > len(self.buffer):
            raise GGUFFormatError(
                f"{self.path}: truncated header: {size} bytes wanted at offset {self.pos}, "
                f"the file has {len(self.buffer)}"
            )
        view = self.buffer[self.pos : end]
        self.pos = end
        return view

    def scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return int(self.scalar(GGUFValueType.UINT32))

    def u64(self) -> int:
        return int(self.scalar(GGUFValueType.UINT64))

    def string(self) -> str:
        raw = self.take(self.u64())
        try:
            return str(raw, encoding="utf-8")
        except UnicodeDecodeError as e:
            message = f"{self.path}: a string at offset {self.pos} is not UTF-8: {e}"
            raise GGUFFormatError(message) from None

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind == GGUFValueType.ARRAY:
            item_kind, count = self.u32(), self.u64()
            if item_kind in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item_kind])
                raw = self.take(count * dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown value type {kind} at offset {self.pos}")


class GGUFFile:
    """``fields``: every metadata key with its value (str, int, float, bool or list, as gguf's
    ``ReaderField.contents()`` gives it); ``tensors``: gguf ``ReaderTensor``s in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as file:
            try:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path}: not a GGUF file (empty)") from None
        data = np.frombuffer(self._map, dtype=np.uint8)
        cursor = _Cursor(data, self.path)
        if cursor.u32() != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = cursor.u32()
        if version & 0xFFFF == 0:
            raise GGUFFormatError(f"{self.path}: a big-endian GGUF; only little-endian is read")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version}; versions 2 and 3 read")
        tensor_count, field_count = cursor.u64(), cursor.u64()
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = cursor.string()
            if key in self.fields:
                raise GGUFFormatError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = cursor.value(cursor.u32())
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.u64() for _ in range(cursor.u32())]
            infos.append((name, dims, cursor.u32(), cursor.u64()))
        alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0:
            raise GGUFFormatError(f"{self.path}: general.alignment is {alignment}")
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[ReaderTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} appears twice")
            seen.add(name)
            self.tensors.append(self._tensor(data, start, name, dims, raw_type, offset))

    def release(self, tensor: ReaderTensor) -> None:
        """Drop the pages of ``tensor``'s data from this process's resident memory, once the
        loader has copied it (a repacked or dequantized weight): without this the whole file
        stays mapped in for the process's life, counted in its RSS, next to the copies made from
        it. The data stays readable: a later read faults it back in from the page cache."""
        page = mmap.PAGESIZE
        begin = -(-tensor.data_offset // page) * page  # whole pages inside the tensor only
        end = (tensor.data_offset + tensor.n_bytes) // page * page
        if end > begin:
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def _tensor(
        self,
        data: np.ndarray[Any, np.dtype[np.uint8]],
        start: int,
        name: str,
        dims: list[int],
        raw_type: int,
        offset: int,
    ) -> ReaderTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            message = f"{self.path}: tensor {name!r} has unknown type {raw_type}"
            raise GGUFFormatError(message) from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(dims, dtype=np.int64))  # 1 for a scalar
        n_bytes = n_elements * type_size // block_size
        begin = start + offset
        if begin + n_bytes > len(data):
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} ({n_bytes} bytes at offset {begin}) runs past "
                f"the end of the file ({len(data)} bytes)"
            )
        shape: tuple[int, ...] = tuple(reversed(dims))
        raw = data[begin : begin + n_bytes]
        if ggml_type in _ELEMENT_DTYPES:
            values = raw.view(_ELEMENT_DTYPES[ggml_type]).reshape(shape)
        else:
            values = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
        return ReaderTensor(
            name=name,
            tensor_type=ggml_type,
            shape=np.array(dims, dtype=np.uint64),
            n_elements=n_elements,
            n_bytes=n_bytes,
            data_offset=begin,
            data=values,
            field=ReaderField(offset=begin, name=name),
        )
