"""The engine core hands the heap memory that loading freed back to the OS before it allocates
the KV cache (glibc ``malloc_trim``), so freed temporaries do not count in its resident set;
then it has glibc keep what a step frees for the next step (``keep_step_memory``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys

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
    monkeypatch.setattr(core, "keep_step_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr(core.EngineCore, "_make_kv_cache", recording_make_kv_cache)
    LLM(model=str(tmp_path), dtype="float32")
    assert calls == ["release", "kv cache", "keep"]


# One activation per step, allocated, written and freed, a little larger each step (20, 21, ...
# 27 MB: a step's batch grows); the page faults of the last three steps. glibc's default serves
# each with fresh pages (its adaptive threshold is the size freed last, below the next one);
# kept, a step faults only what it adds to the heap. The first steps after the setting may
# still fault a whole activation while the heap settles (steps 1-3 did in about a third of the
# runs, measured; step 4 on never did), as an engine's first steps do. Run in a fresh
# interpreter: the setting is the process's.
_STEPS = """
import resource, sys, torch
from cenote.engine.core import keep_step_memory
if sys.argv[1] == "keep":
    assert keep_step_memory()
faults = 0
for step in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activation = torch.ones((20 + step) << 18)
    del activation
    if step >= 5:
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""


def _faults_of_a_step(mode: str) -> int:
    env = {**os.environ, "CENOTE_KEEP_STEP_MEMORY": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, env=env, check=True
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_steps_reuse_the_memory_the_step_before_freed() -> None:
    """By default every step faults its whole activation in (19,971 pages over the three,
    measured); kept, only what it adds to the heap (768-2,048: a megabyte a step, and the
    heap's growth steps)."""
    default, kept = _faults_of_a_step("default"), _faults_of_a_step("keep")
    assert default > 12000, f"glibc's default faulted only {default} pages: the test shows nothing"
    assert kept < 6000, f"{kept} page faults in three steps"


def test_keep_step_memory_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("CENOTE_KEEP_STEP_MEMORY", "0")
    assert core.keep_step_memory() is False


def test_a_started_process_freezes_what_is_alive() -> None:
    """freeze_startup_objects (the engine core process and the server front, once started):
    garbage in reference cycles is collected first, everything alive after that is frozen out
    of the collector's sight. In a subprocess: a frozen heap is the whole process's."""
    script = """
import gc, weakref
from cenote.engine.heap import freeze_startup_objects
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_objects()
assert gone() is None, "cyclic garbage left alive"
assert frozen == gc.get_freeze_count() > 1000, frozen
ids = {id(o) for o in gc.get_objects()}
assert gc.is_tracked(kept[0]) and id(kept[0]) not in ids, "a live object left in sight"
print(frozen)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 1000


def test_an_in_process_call_sets_the_old_heap_aside_and_gives_it_back() -> None:
    """old_objects_set_aside (around the offline LLM's calls): what is alive on entry is out of
    the collector's sight inside the call, nested calls keep it so until the last one leaves,
    and on exit everything is collectable again: cyclic garbage made before the call (a dropped
    LLM, say) is collected after it; a process frozen for life stays frozen. In a subprocess:
    the freeze is the whole process's."""
    script = """
import gc, weakref
from cenote.engine.heap import freeze_startup_objects, old_objects_set_aside
class Node: pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)
kept = [Node() for _ in range(1000)]
assert gc.get_freeze_count() == 0
with old_objects_set_aside():
    gone = cycle()  # made inside: collected as usual
    gc.collect()
    assert gone() is None, "garbage made inside the call left alive"
    assert gc.get_freeze_count() > 1000
    assert id(kept[0]) not in {id(o) for o in gc.get_objects()}, "old object in sight"
    gone = cycle()
    with old_objects_set_aside():
        pass
    assert gc.get_freeze_count() > 1000, "the inner call gave the heap back early"
assert gc.get_freeze_count() == 0
gc.collect()
assert gone() is None, "garbage frozen during a call never collected"
frozen = freeze_startup_objects()
with old_objects_set_aside():
    pass
assert gc.get_freeze_count() == frozen, "a process frozen for life was unfrozen"
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
