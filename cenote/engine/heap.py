"""The heap of a process: Python's once it has finished starting (engine core or server
front), and glibc's once a load or an unload has freed a lot of it."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (the model's modules and parameters,
    torch's and the libraries' own: about 230,000 with SmolLM2 loaded) out of the garbage
    collector's sight (``gc.freeze``; vLLM does the same after loading). Python's full
    collections, which the steps' allocations trigger, otherwise walk them all each time: a
    pause of a few to tens of milliseconds in the middle of a step. Measured on AMD EPYC Zen 4
    (one-stream SmolLM2 decode, 8 alternated pairs in one process): 1.04x.

    Only for processes that hold one engine for their whole life (the engine core process, the
    server front): a frozen object in a reference cycle is never collected, so an in-process
    ``LLM`` (of which a program may make and drop several) does not freeze. Returns how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_freed_memory() -> None:
    """Return the heap memory that loading freed to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere). Loading dequantizes and prepacks weights through temporaries that glibc keeps
    in its heap after they are freed; the KV cache, allocated next, cannot reuse them, so they
    would count in the process's resident set and its peak (SmolLM2 GGUF: 130 MB). The server
    front calls it after unloading a model (its tokenizer and caches)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(ctypes.c_size_t(0))
