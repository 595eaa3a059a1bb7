"""The heap of a process: Python's once it has finished starting (engine core or server
front), and glibc's once a load or an unload has freed a lot of it."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_frozen_for_life = False  # freeze_startup_objects ran: the heap stays frozen
_set_aside = 0  # nesting depth of old_objects_set_aside in this process
_set_aside_lock = threading.Lock()


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (the model's modules and parameters,
    torch's and the libraries' own: about 230,000 with SmolLM2 loaded) out of the garbage
    collector's sight (``gc.freeze``; vLLM does the same after loading). Python's full
    collections, which the steps' allocations trigger, otherwise walk them all each time: a
    pause of a few to tens of milliseconds in the middle of a step (one-stream decode gains:
    docs/performance.md, "numbers out of code comments").

    Only for processes that hold one engine for their whole life (the engine core process, the
    server front): a frozen object in a reference cycle is never collected, so an in-process
    ``LLM`` (of which a program may make and drop several) does not freeze. Returns how many
    objects are frozen."""
    global _frozen_for_life
    gc.collect()
    gc.freeze()
    _frozen_for_life = True
    return gc.get_freeze_count()


@contextmanager
def old_objects_set_aside() -> Iterator[None]:
    """The in-process ``LLM``'s form of the freeze above: every object alive on entry (the
    model, torch, the libraries) is out of the collector's sight for the call and back in its
    oldest generation on exit, so nothing frozen outlives the call and a dropped ``LLM`` is
    still collected. ``gc.freeze`` / ``gc.unfreeze`` move whole lists (constant time); the
    objects the call creates (thousands of requests and their token lists) are collected as
    usual. What it saves: the full collections those allocations trigger walked the whole
    startup heap (docs/performance.md, "the host's share"). Nested and concurrent calls keep it
    set aside until the last one leaves; a process frozen for life is left as it is."""
    global _set_aside
    with _set_aside_lock:
        if not _frozen_for_life and _set_aside == 0:
            gc.freeze()
        _set_aside += 1
    try:
        yield
    finally:
        with _set_aside_lock:
            _set_aside -= 1
            if not _frozen_for_life and _set_aside == 0:
                gc.unfreeze()


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
