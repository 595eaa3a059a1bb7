"""The exact embedding cache (``--embedding-cache-size``): what its key holds, LRU bounds, and a
served cache's answers against recomputed ones (fp32: the same bytes), computing only misses."""

from __future__ import annotations

import base64
import dataclasses
import re

import httpx
import numpy as np
import pytest
import torch
from conftest import NUM_THREADS

from cenote.cli import main as cli
from cenote.engine.embedding_cache import (
    OUTPUT_NEUTRAL_PARAMS,
    OUTPUT_NEUTRAL_REQUEST_FIELDS,
    CacheSize,
    EmbeddingCache,
    cache_key,
    parse_cache_size,
)
from cenote.engine.input_processor import ParentRequest
from cenote.lora_request import LoRARequest
from cenote.messages import EngineCoreRequest
from cenote.outputs import EmbeddingOutput, PoolingRequestOutput
from cenote.pooling_params import PoolingParams

# one changed value per field that changes a result: a field added to PoolingParams or
# EngineCoreRequest must be listed here (it is in the key) or as output-neutral
PARAMS_VARIANTS = {
    "task": "classify",
    "dimensions": 8,
    "normalize": False,
    "use_activation": False,
    "step_tag_id": 5,
    "returned_token_ids": [1, 2],
    "max_active_dims": 3,
    "instruction_length": 2,
    "lora_task": "retrieval.query",  # also in the key as its adapter (lora_request)
}
REQUEST_VARIANTS = {
    "prompt_token_ids": [101, 7, 102],
    "token_type_ids": [0, 0, 1],
    "pooling_params": PoolingParams(task="embed", normalize=False),
    "lora_request": LoRARequest("sql", 1, "/adapters/sql"),
    "pixel_values": torch.zeros(3, 2, 2),  # an image prompt: keyed by its pixels' bytes
}


def _request(
    token_ids: list[int], task: str = "embed", request_id: str = "r", **params: object
) -> ParentRequest:
    pooling = PoolingParams(task=task, **params)  # type: ignore[arg-type]
    core = EngineCoreRequest(request_id, token_ids, None, pooling)
    return ParentRequest(request_id, None, [core])


def _output(request: ParentRequest, value: float, width: int = 4) -> PoolingRequestOutput:
    data = torch.full((width,), value)
    return PoolingRequestOutput(request.request_id, EmbeddingOutput(data), request.prompt_token_ids)


# ---- the key -----------------------------------------------------------------------------------


def test_every_pooling_params_field_is_keyed_or_declared_neutral() -> None:
    names = {f.name for f in dataclasses.fields(PoolingParams)}
    assert OUTPUT_NEUTRAL_PARAMS <= names, "a neutral name is no PoolingParams field"
    assert set(PARAMS_VARIANTS) | OUTPUT_NEUTRAL_PARAMS == names, (
        f"PoolingParams fields neither keyed nor neutral: "
        f"{names - set(PARAMS_VARIANTS) - OUTPUT_NEUTRAL_PARAMS}"
    )
    base = EngineCoreRequest("a", [101, 7, 102], None, PoolingParams(task="embed"))
    for name, value in PARAMS_VARIANTS.items():
        params = dataclasses.replace(base.pooling_params, **{name: value})  # type: ignore[type-var]
        changed = dataclasses.replace(base, pooling_params=params)
        assert cache_key("m", changed) != cache_key("m", base), name
    # truncation and prompts acted on the token ids already; a chunked request is not cached
    neutral_values = {"truncate_prompt_tokens": 3, "truncation_side": "left", "prompt": "q: ",
                      "prompt_name": "query", "long_input": "chunk", "chunk_overlap": 3}  # fmt: skip
    assert set(neutral_values) == OUTPUT_NEUTRAL_PARAMS
    for name in OUTPUT_NEUTRAL_PARAMS:
        params = dataclasses.replace(base.pooling_params, **{name: neutral_values[name]})  # type: ignore[type-var]
        assert cache_key("m", dataclasses.replace(base, pooling_params=params)) == cache_key(
            "m", base
        ), name


def test_every_engine_request_field_is_keyed_or_declared_neutral() -> None:
    names = {f.name for f in dataclasses.fields(EngineCoreRequest)}
    assert OUTPUT_NEUTRAL_REQUEST_FIELDS <= names
    assert set(REQUEST_VARIANTS) | OUTPUT_NEUTRAL_REQUEST_FIELDS == names
    base = EngineCoreRequest("a", [101, 8, 102], None, PoolingParams(task="embed"))
    for name, value in REQUEST_VARIANTS.items():
        changed = dataclasses.replace(base, **{name: value})
        assert cache_key("m", changed) != cache_key("m", base), name
    image = dataclasses.replace(base, pixel_values=torch.zeros(3, 2, 2))
    same_pixels = dataclasses.replace(base, pixel_values=torch.zeros(3, 2, 2))
    assert cache_key("m", image) == cache_key("m", same_pixels)
    neutral = dataclasses.replace(base, request_id="b", priority=4, eos_token_id=2, group_id="g")
    assert cache_key("m", neutral) == cache_key("m", base)
    assert cache_key("other-model", base) != cache_key("m", base)


# ---- the LRU -------------------------------------------------------------------------------------


def test_entries_bound_evicts_the_least_recently_used() -> None:
    cache = EmbeddingCache(CacheSize(max_entries=2), "m")
    a, b, c = (_request([101, i, 102], request_id=f"r{i}") for i in (1, 2, 3))
    for request, value in ((a, 1.0), (b, 2.0)):
        lookup = cache.lookup([request])
        cache.complete(lookup, [_output(request, value)])
    assert cache.lookup([a]).num_hits == 1  # a is now the most recent
    lookup = cache.lookup([c])
    cache.complete(lookup, [_output(c, 3.0)])
    assert len(cache) == 2 and cache.num_evictions == 1
    assert cache.lookup([b]).num_misses == 1 and cache.lookup([a]).num_hits == 1


def test_bytes_bound_counts_results_and_keys() -> None:
    one = CacheSize(max_bytes=1)
    cache = EmbeddingCache(one, "m")
    request = _request([101, 1, 102])
    cache.complete(cache.lookup([request]), [_output(request, 1.0)])
    assert len(cache) == 0, "an entry larger than the bound is not kept"
    cache = EmbeddingCache(CacheSize(max_bytes=3 * (512 + 4 * 256 + 3 * 8)), "m")
    for i in range(5):
        request = _request([101, i, 102], request_id=f"r{i}")
        cache.complete(cache.lookup([request]), [_output(request, float(i), width=256)])
    assert len(cache) == 3 and cache.num_bytes == 3 * (512 + 1024 + 24)
    assert cache.num_bytes <= cache.size.max_bytes and cache.num_evictions == 2


def test_a_call_computes_each_distinct_input_once_and_hands_out_copies() -> None:
    cache = EmbeddingCache(CacheSize(max_entries=10), "m")
    a1, b, a2 = _request([1, 2], request_id="x0"), _request([3], request_id="x1"), None
    a2 = _request([1, 2], request_id="x2")
    token_level = _request([1, 2], task="token_embed", request_id="x3")
    lookup = cache.lookup([a1, b, a2, token_level])
    assert [m.request_id for m in lookup.misses] == ["x0", "x1", "x3"]
    assert (lookup.num_hits, lookup.num_misses) == (1, 2)  # token_embed is not cacheable
    results = cache.complete(lookup, [_output(a1, 1.0), _output(b, 2.0), _output(token_level, 9)])
    assert [r.request_id for r in results] == ["x0", "x1", "x2", "x3"]
    assert torch.equal(results[2].outputs.data, results[0].outputs.data)
    results[0].outputs.data.fill_(-1.0)  # a caller changing its result changes nothing stored
    (hit,) = cache.complete(cache.lookup([a1]), [])
    assert torch.equal(hit.outputs.data, torch.full((4,), 1.0))
    assert len(cache) == 2


def test_a_chunked_text_is_computed_every_time() -> None:
    """Its windows' embeddings join in the output processor: the cache never keys them."""
    from cenote.engine.chunking import ChunkPlan

    cache = EmbeddingCache(CacheSize(max_entries=10), "m")
    chunked = dataclasses.replace(
        _request([1, 2], request_id="c"), chunks=ChunkPlan((2,), None, True)
    )
    for _ in range(2):
        lookup = cache.lookup([chunked])
        assert lookup.keys == [None] and (lookup.num_hits, lookup.num_misses) == (0, 0)
        cache.complete(lookup, [_output(chunked, 1.0)])
    assert len(cache) == 0


# ---- the command line ------------------------------------------------------------------------


def test_cache_sizes_parse() -> None:
    assert parse_cache_size("10000") == CacheSize(max_entries=10000)
    assert parse_cache_size("512MiB") == CacheSize(max_bytes=512 << 20)
    assert parse_cache_size("2GB") == CacheSize(max_bytes=2 << 30)
    assert not parse_cache_size("0").enabled


@pytest.mark.parametrize(
    ("value", "message"),
    [("foo", "expected a number of entries"), ("-5", "0 (off) or more"), ("12XB", "a unit")],
)
def test_a_cache_size_that_is_not_a_size_exits_2_quoting_it(value, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli._parser().parse_args(["serve", "--embedding-cache-size", value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--embedding-cache-size" in error and repr(value) in error and message in error


# ---- served: the same answers, only misses computed ----------------------------------------------

TEXTS = ["A cached sentence.", "Another one here.", "A third, new text.", "And a fourth text."]


@pytest.fixture(scope="module")
def cache_server():
    """MiniLM fp32 with the cache on (the one server these tests share)."""
    from tests.server_fixture import ServerProcess

    server = ServerProcess(
        "--dtype", "float32", "--num-threads", str(NUM_THREADS),
        "--embedding-cache-size", "1000",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _embed(url: str, texts: list[str], **extra: object) -> tuple[list[bytes], int]:
    body = {"input": texts, "encoding_format": "base64", **extra}
    response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 200, response.text
    payload = response.json()
    vectors = [base64.b64decode(item["embedding"]) for item in payload["data"]]
    return vectors, payload["usage"]["prompt_tokens"]


def _tokens(url: str, text: str) -> int:
    response = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10)
    return int(response.json()["count"])


def test_a_cached_embedding_is_the_recomputed_one_bit_for_bit(default_server, cache_server):
    # default_server: the same model and dtype, cache off
    reference, _ = _embed(default_server.url, TEXTS[:2])
    first, _ = _embed(cache_server.url, TEXTS[:2])
    hits = _metric(cache_server.url, "cenote_embedding_cache_hits_total")
    second, _ = _embed(cache_server.url, TEXTS[:2])
    third, _ = _embed(cache_server.url, TEXTS[1::-1])
    assert _metric(cache_server.url, "cenote_embedding_cache_hits_total") == hits + 4
    assert first == reference and second == reference and third == reference[::-1]
    # a parameter that changes the result is another entry
    raw, _ = _embed(cache_server.url, TEXTS[:1], normalize=False)
    (raw_reference,), _ = _embed(default_server.url, TEXTS[:1], normalize=False)
    assert raw == [raw_reference] and raw[0] != reference[0]
    assert np.linalg.norm(np.frombuffer(raw[0], dtype=np.float32)) > 1.5


def test_a_request_mixing_hits_and_misses_computes_only_the_misses(default_server, cache_server):
    url = cache_server.url
    _embed(url, TEXTS[:2])  # cached (here or by the test before)
    computed = "cenote_scheduled_tokens_per_step_sum"
    before = {n: _metric(url, n) for n in (computed, "cenote_embedding_cache_misses_total")}
    mixed = [TEXTS[0], TEXTS[2], TEXTS[1], TEXTS[3], TEXTS[2]]
    vectors, usage = _embed(url, mixed)
    new_tokens = _tokens(url, TEXTS[2]) + _tokens(url, TEXTS[3])
    assert _metric(url, computed) - before[computed] == new_tokens
    assert (
        _metric(url, "cenote_embedding_cache_misses_total")
        - before["cenote_embedding_cache_misses_total"]
        == 2
    )
    assert usage == sum(_tokens(url, t) for t in mixed), "usage counts cached inputs too"
    reference, _ = _embed(default_server.url, mixed)
    assert vectors == reference
    assert _metric(url, "cenote_embedding_cache_entries") >= 5  # 4 texts + normalize=False
    assert _metric(url, "cenote_embedding_cache_bytes") > 4 * 384 * 4


def test_a_cached_bf16_embedding_is_within_the_bf16_bound(minilm_path) -> None:
    """bf16 is batch-invariant within its bound, not bit for bit: a hit (the first computation)
    against a recomputation in another batch, and both against fp32 (DESIGN.md §3, tests/test_bf16)."""
    from cenote import LLM

    llm = LLM(str(minilm_path), dtype="bfloat16", num_threads=NUM_THREADS)
    cache = EmbeddingCache(CacheSize(max_entries=10), "m")
    params = PoolingParams(task="embed")
    processor = llm.input_processor

    def run(ids: list[str], texts: list[str], cached: bool) -> list[torch.Tensor]:
        requests = processor.process_batch(ids, texts, params)
        if not cached:
            return [o.outputs.data for o in llm.client.run(requests)]
        lookup = cache.lookup(requests)
        computed = llm.client.run(lookup.misses) if lookup.misses else []
        return [o.outputs.data for o in cache.complete(lookup, computed)]

    (alone,) = run(["a"], [TEXTS[0]], cached=True)
    hit = run(["b0", "b1", "b2"], [TEXTS[2], TEXTS[0], TEXTS[3]], cached=True)[1]
    recomputed = run(["c0", "c1", "c2"], [TEXTS[2], TEXTS[0], TEXTS[3]], cached=False)[1]
    assert torch.equal(hit, alone)
    cosine = torch.nn.functional.cosine_similarity(hit, recomputed, dim=0)
    assert cosine >= 0.999, f"bf16 cached vs recomputed: cosine {cosine:.5f}"


def test_score_inputs_are_cached_like_embeddings(cache_server) -> None:
    body = {"text_1": TEXTS[0], "text_2": [TEXTS[1], "An uncached document."]}
    hits = _metric(cache_server.url, "cenote_embedding_cache_hits_total")
    first = httpx.post(f"{cache_server.url}/score", json=body, timeout=60).json()
    second = httpx.post(f"{cache_server.url}/score", json=body, timeout=60).json()
    assert [d["score"] for d in first["data"]] == [d["score"] for d in second["data"]]
    assert _metric(cache_server.url, "cenote_embedding_cache_hits_total") - hits >= 3
