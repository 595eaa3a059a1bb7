"""The engine core hands the heap memory that loading freed back to the OS before it allocates
the KV cache (glibc ``malloc_trim``), so freed temporaries do not count in its resident set."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import pytest

from cenote.engine import core
from cenote.engine.core import release_freed_memory

CHUNK = 100 * 1024  # below glibc's mmap threshold: served from the heap
NUM_CHUNKS = 300  # 30 MB


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_memory_leaves_the_resident_set() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # the highest chunk stays allocated above the others, so glibc cannot hand them back by
    # shrinking the heap's top when they are freed
    chunks = sorted(libc.malloc(CHUNK) for _ in range(NUM_CHUNKS + 1))
    guard = chunks.pop()
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    for chunk in chunks:
        libc.free(chunk)
    before = _resident_bytes()
    release_freed_memory()
    after = _resident_bytes()
    libc.free(guard)
    released = before - after
    assert released > NUM_CHUNKS * CHUNK // 2, f"only {released / 2**20:.1f} MiB returned"


def test_the_core_releases_before_it_allocates_the_kv_cache(tmp_path, monkeypatch) -> None:
    """Order matters: the KV cache cannot reuse the freed heap, so releasing after it would
    leave the peak where it was."""
    from factories.decoders import make_decoder

    from cenote import LLM

    make_decoder(tmp_path, "llama")
    calls: list[str] = []
    make_kv_cache = core.EngineCore._make_kv_cache

    def recording_make_kv_cache(self):
        calls.append("kv cache")
        return make_kv_cache(self)

    monkeypatch.setattr(core, "release_freed_memory", lambda: calls.append("release"))
    monkeypatch.setattr(core.EngineCore, "_make_kv_cache", recording_make_kv_cache)
    LLM(model=str(tmp_path), dtype="float32")
    assert calls == ["release", "kv cache"]
