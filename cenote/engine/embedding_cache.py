"""An exact cache of pooling results in the front: a repeated input is answered without the
engine core. Pooling is batch-invariant (DESIGN.md §3), so a stored result is the one a
recomputation gives (fp32: bit for bit).

The key is everything of an engine request that changes its result: the model, the prompt's
token ids (after truncation and instruction prompts), its token type ids, and every
``PoolingParams`` field but the ones listed as output-neutral; a field added later joins the
key by itself (``tests/engine/test_embedding_cache.py`` checks the lists name real fields). Entries
are evicted least recently used first, bounded by a count or by bytes. Token-level results
(``token_embed``, ``token_classify``: a row per prompt token) are not cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cenote.engine.input_processor import ParentRequest
from cenote.engine_args import parse_bytes
from cenote.lora_request import LoRARequest
from cenote.messages import EngineCoreRequest
from cenote.outputs import PoolingOutput, PoolingRequestOutput
from cenote.pooling_params import PoolingParams

# fields whose effect is already in the token ids (truncation, the instruction prompt's text),
# or that never change a cached result (chunking: a chunked request is not cached)
OUTPUT_NEUTRAL_PARAMS = frozenset(
    {"truncate_prompt_tokens", "truncation_side", "prompt_name", "prompt", "long_input",
     "chunk_overlap"}
)  # fmt: skip
OUTPUT_NEUTRAL_REQUEST_FIELDS = frozenset(
    {"request_id", "sampling_params", "eos_token_id", "arrival_time", "priority", "group_id"}
)
CACHED_TASKS = frozenset({"embed", "classify", "embed_sparse"})  # one result per input
_ENTRY_OVERHEAD_BYTES = 512  # an entry's Python objects (dict slot, key tuple, tensor object)


@dataclass(frozen=True)
class CacheSize:
    """How much an embedding cache may hold: ``max_entries`` results, or ``max_bytes`` of
    results and keys (both 0: no cache)."""

    max_entries: int = 0
    max_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 or self.max_bytes > 0

    def __str__(self) -> str:
        if self.max_bytes:
            return f"{self.max_bytes} bytes"
        return f"{self.max_entries} entries" if self.max_entries else "0 (off)"


def parse_cache_size(text: str) -> CacheSize:
    """``10000`` -> 10000 entries; ``512MiB`` / ``2GB`` -> bytes (binary units, as
    ``parse_bytes``); ``0`` -> off."""
    value = text.strip()
    if value.startswith("-"):
        raise argparse.ArgumentTypeError(f"a cache size is 0 (off) or more, got {text!r}")
    if re.fullmatch(r"\d+", value):
        return CacheSize(max_entries=int(value))
    if re.fullmatch(r"\d+\s*[KMGT]?i?B|\d+\s*[KMGT]", value, re.IGNORECASE):
        return CacheSize(max_bytes=parse_bytes(value))
    raise argparse.ArgumentTypeError(
        "expected a number of entries (e.g. 10000) or a size with a unit (e.g. 512MiB, 2GB; "
        f"B, K, M, G, T, binary); 0 turns the cache off; got {text!r}"
    )


def _part(value: Any) -> Hashable:
    """A request field as part of a key: int lists as packed bytes, dataclasses field by
    field, other values as they are (they must be hashable)."""
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return array("q", value).tobytes()
        return tuple(_part(v) for v in value)
    if isinstance(value, PoolingParams):
        return tuple(
            (f.name, _part(getattr(value, f.name)))
            for f in dataclasses.fields(value)
            if f.name not in OUTPUT_NEUTRAL_PARAMS
        )
    if isinstance(value, torch.Tensor):  # an image's pixels: equal pixels, equal key
        return (str(value.dtype), tuple(value.shape), value.contiguous().numpy().tobytes())
    if isinstance(value, LoRARequest):  # the adapter: two adapters never share an entry
        return ("lora", value.lora_int_id, value.lora_name, value.lora_path)
    assert not dataclasses.is_dataclass(value), f"no key form for {type(value).__name__}"
    return value  # type: ignore[no-any-return]


def cache_key(model: str, request: EngineCoreRequest) -> tuple[Hashable, ...]:
    """What decides ``request``'s pooling result."""
    return (model,) + tuple(
        (f.name, _part(getattr(request, f.name)))
        for f in dataclasses.fields(request)
        if f.name not in OUTPUT_NEUTRAL_REQUEST_FIELDS
    )


def _key_bytes(key: tuple[Hashable, ...]) -> int:
    """The packed token ids in ``key`` (its other parts are small)."""
    num_bytes = 0
    for part in key:
        if isinstance(part, tuple) and isinstance(part[1], bytes):
            num_bytes += len(part[1])
    return num_bytes


@dataclass
class _Entry:
    output: PoolingOutput
    num_bytes: int


@dataclass
class CacheLookup:
    """One call's inputs split into results found (``outputs[i]`` set) and ``misses``, the
    requests to compute: one per distinct key (an input repeated in the call runs once)."""

    requests: list[ParentRequest]
    keys: list[tuple[Hashable, ...] | None]  # None: not cacheable
    outputs: list[PoolingRequestOutput[Any] | None]
    misses: list[ParentRequest]
    num_hits: int  # inputs answered without computing them (stored, or repeated in the call)
    num_misses: int  # cacheable inputs to compute


class EmbeddingCache:
    """LRU of pooling results by ``cache_key``. ``lookup`` -> compute the misses ->
    ``complete``; results handed out are copies, so no caller can change a stored one."""

    def __init__(self, size: CacheSize, model: str) -> None:
        assert size.enabled, "a disabled cache is no cache object"
        self.size = size
        self.model = model
        self._entries: OrderedDict[tuple[Hashable, ...], _Entry] = OrderedDict()
        self.num_bytes = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, requests: Sequence[ParentRequest]) -> CacheLookup:
        keys: list[tuple[Hashable, ...] | None] = []
        outputs: list[PoolingRequestOutput[Any] | None] = []
        misses: dict[tuple[Hashable, ...] | int, ParentRequest] = {}
        num_hits = num_misses = 0
        for i, request in enumerate(requests):
            params = request.pooling_params
            # a chunked text's windows join in the output processor: its result is not cached
            cacheable = params is not None and params.task in CACHED_TASKS and not request.chunks
            key = cache_key(self.model, request.children[0]) if cacheable else None
            keys.append(key)
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                self._entries.move_to_end(key)  # type: ignore[arg-type]
                outputs.append(_answer(request, entry.output))
                num_hits += 1
                continue
            outputs.append(None)
            if key is not None and key in misses:
                num_hits += 1  # computed once for the call
                continue
            num_misses += key is not None
            misses[key if key is not None else i] = request
        misses_list = list(misses.values())
        return CacheLookup(list(requests), keys, outputs, misses_list, num_hits, num_misses)

    def complete(
        self, lookup: CacheLookup, computed: Sequence[PoolingRequestOutput[Any]]
    ) -> list[PoolingRequestOutput[Any]]:
        """Store the computed results of ``lookup.misses`` (in that order); every input's
        result, in input order."""
        by_id = {miss.request_id: out for miss, out in zip(lookup.misses, computed, strict=True)}
        stored: dict[tuple[Hashable, ...], PoolingOutput] = {}
        results = []
        for request, key, found in zip(lookup.requests, lookup.keys, lookup.outputs, strict=True):
            if found is not None:
                results.append(found)
            elif request.request_id in by_id:
                out = by_id[request.request_id]
                if key is not None:
                    stored[key] = self._store(key, out.outputs)
                results.append(out)
            else:  # a repeat of an input computed in this call (after it: misses keep the first)
                assert key is not None
                results.append(_answer(request, stored[key]))
        return results

    def _store(self, key: tuple[Hashable, ...], output: PoolingOutput) -> PoolingOutput:
        """Keep a private copy of ``output`` (the computed tensor may view a larger buffer,
        and it goes on to a caller); the copy."""
        stored = dataclasses.replace(output, data=output.data.clone())
        num_bytes = stored.data.nbytes + _key_bytes(key) + _ENTRY_OVERHEAD_BYTES
        if self.size.max_bytes and num_bytes > self.size.max_bytes:
            return stored
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._entries[key] = _Entry(stored, num_bytes)
        self.num_bytes += num_bytes
        while self._over_bound():
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
            self.num_evictions += 1
        return stored

    def _over_bound(self) -> bool:
        if self.size.max_entries:
            return len(self._entries) > self.size.max_entries
        return self.num_bytes > self.size.max_bytes


def _answer(request: ParentRequest, output: PoolingOutput) -> PoolingRequestOutput[Any]:
    """``request``'s result from a stored one (a copy of its tensor)."""
    data: torch.Tensor = output.data.clone()
    return PoolingRequestOutput(
        request.request_id, dataclasses.replace(output, data=data), request.prompt_token_ids
    )
