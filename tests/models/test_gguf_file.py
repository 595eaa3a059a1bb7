"""cenote's GGUF header reader (cenote/models/formats/gguf_file.py) against gguf's own ``GGUFReader``.

Every metadata value and every tensor (name, type, shape, offset, bytes) must read as gguf's
reader reads it: on the real SmolLM2 file and on a file written here with every value type, empty
strings and arrays, a custom alignment and dense and quantized tensors. A damaged file is refused
with where and why, never a crash.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from factories.generation import smollm2_path
from factories.gguf import write_and_close

from cenote.models.formats.gguf_file import GGUFFile, GGUFFormatError


def assert_reads_as_gguf_reader(path: Path) -> None:
    theirs = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert np.array_equal(a.shape, b.shape)
        assert (a.data.shape, a.data.dtype) == (b.data.shape, b.data.dtype), a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


def test_smollm2_reads_as_gguf_reader() -> None:
    assert_reads_as_gguf_reader(smollm2_path())


@pytest.fixture(scope="module")
def every_type(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "every_type.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -32000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld 🙂")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1e-5])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    writer.add_array("t.none", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("dense.f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("dense.f16", rng.standard_normal((64,)).astype(np.float16))
    writer.add_tensor("dense.i32", np.arange(10, dtype=np.int32))
    weights = rng.standard_normal((4, 64), dtype=np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        data = gguf.quants.quantize(weights, qtype)
        name = f"quant.{qtype.name}"
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    write_and_close(writer)
    return path


def test_every_value_type_reads_as_gguf_reader(every_type: Path) -> None:
    assert_reads_as_gguf_reader(every_type)
    fields = GGUFFile(every_type).fields
    assert fields["t.str"] == "héllo ▁wörld 🙂" and fields["t.u64"] == 2**63 + 5
    assert fields["general.alignment"] == 64


def test_quantized_tensor_dequantizes_as_written(every_type: Path) -> None:
    tensor = {t.name: t for t in GGUFFile(every_type).tensors}["quant.Q8_0"]
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert values.shape == (4, 64)
    reference = gguf.GGUFReader(every_type).tensors[-2]
    assert np.array_equal(values, gguf.quants.dequantize(reference.data, reference.tensor_type))


# ---- damaged files ----------------------------------------------------------------------------


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(path)


def test_truncated_header_names_the_offset(every_type: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(every_type.read_bytes()[:100])
    with pytest.raises(GGUFFormatError, match=r"truncated header: \d+ bytes wanted at offset \d+"):
        GGUFFile(path)


def test_truncated_tensor_data_is_named(every_type: Path, tmp_path: Path) -> None:
    last = GGUFFile(every_type).tensors[-1]
    path = tmp_path / "short.gguf"
    path.write_bytes(every_type.read_bytes()[: last.data_offset + last.n_bytes - 1])
    with pytest.raises(GGUFFormatError, match=r"'quant\.Q4_1' .* runs past the end of the file"):
        GGUFFile(path)


def test_unknown_version_is_refused(every_type: Path, tmp_path: Path) -> None:
    data = bytearray(every_type.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    path = tmp_path / "v7.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="GGUF version 7"):
        GGUFFile(path)


def test_damaged_gguf_is_a_clear_error_through_llm(tmp_path: Path) -> None:
    from cenote import LLM

    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_path().read_bytes()[:4096])
    with pytest.raises(GGUFFormatError, match="truncated header"):
        LLM(str(path))


def test_a_damaged_file_is_a_gguf_error(tmp_path: Path) -> None:
    """Callers that catch the loader's GGUFError catch a damaged file too."""
    from cenote.models.gguf_loader import GGUFError, load_gguf

    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="truncated header: 4 bytes wanted at offset 4"):
        load_gguf(path)


def test_empty_file_is_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(path)


def mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_loaded_tensors_leave_the_resident_memory() -> None:
    """Once the loader has its copies, the file's pages leave this process's RSS (the engine
    core's peak memory counted all 86 MB of SmolLM2's file next to the copies made from it) and
    the data is still readable after, faulted back in from the page cache."""
    from cenote.models.gguf_loader import load_gguf

    path = smollm2_path().resolve()  # /proc/self/smaps names the resolved file
    checkpoint = load_gguf(path)
    size_kib = path.stat().st_size // 1024
    sums = [int(t.data.sum()) for t in checkpoint.reader.tensors]  # touches every page
    assert mapped_rss_kib(path) > size_kib * 0.9
    names = [name for name, _ in checkpoint.tensors(keep_quantized=True)]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert mapped_rss_kib(path) < size_kib * 0.05
    assert [int(t.data.sum()) for t in checkpoint.reader.tensors] == sums
