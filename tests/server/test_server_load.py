"""Bounded load: a few hundred concurrent requests, every answer equal to the offline engine.

The default server takes embeddings, score, rerank and tokenize at concurrency 32 (requests
batched together in the core: embeddings within 1e-5 of the offline engine's, DESIGN.md §3);
the SmolLM2 server takes greedy completions and chats at concurrency 16 (token-identical to
``LLM.generate`` / ``LLM.chat``). No timing asserts: this is about correctness under load.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from factories.texts import PROSE

from cenote import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.load

MAX_ABS_DIFF_FP32 = 1e-5  # DESIGN.md §3: batch invariance in fp32
NUM_POOLING_REQUESTS = 256
POOLING_CONCURRENCY = 32
NUM_GENERATION_REQUESTS = 128
GENERATION_CONCURRENCY = 16
MAX_TOKENS = 12

_WORDS = " ".join(PROSE).split()


def _texts(num_texts: int, seed: int) -> list[str]:
    """Prose slices of seeded, mixed lengths (3 to 120 words)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        start, n = rng.randrange(len(_WORDS)), rng.choice([3, 5, 12, 30, 60, 120])
        texts.append(" ".join((_WORDS * 2)[start : start + n]))
    return texts


async def _send_all(url: str, requests: list[tuple[str, dict]], concurrency: int) -> list:
    """POST every ``(path, body)``, at most ``concurrency`` in flight; the JSON answers in order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def send(path: str, body: dict) -> dict:
            async with gate:
                response = await client.post(path, json=body)
            assert response.status_code == 200, f"{path} {body}: {response.text}"
            return response.json()

        return await asyncio.gather(*(send(path, body) for path, body in requests))


# ---- default model: embeddings, score, rerank, tokenize -------------------------------------


def _pooling_requests(texts: list[str], seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_POOLING_REQUESTS):
        kind = ("embeddings", "score", "rerank", "tokenize")[i % 4]
        if kind == "embeddings":
            requests.append(("/v1/embeddings", {"input": rng.sample(texts, rng.randint(1, 4))}))
        elif kind == "score":
            query, *documents = rng.sample(texts, rng.randint(2, 5))
            requests.append(("/score", {"queries": query, "documents": documents}))
        elif kind == "rerank":
            query, *documents = rng.sample(texts, rng.randint(2, 5))
            requests.append(("/v1/rerank", {"query": query, "documents": documents}))
        else:
            requests.append(("/tokenize", {"prompt": rng.choice(texts)}))
    return requests


def test_pooling_routes_under_load_equal_the_offline_engine(default_server, llm_fp32: LLM):
    texts = _texts(48, seed=5)
    requests = _pooling_requests(texts, seed=6)
    answers = asyncio.run(_send_all(default_server.url, requests, POOLING_CONCURRENCY))

    # the offline engine, fp32, same options: one batch of every text, one score call per pair
    embedding = dict(zip(texts, (o.outputs.data.float() for o in llm_fp32.embed(texts)), strict=True))  # fmt: skip
    embed = PoolingParams(task="embed")
    tokens = {t: llm_fp32.input_processor.process(t, t, embed).prompt_token_ids for t in texts}
    for (path, body), answer in zip(requests, answers, strict=True):
        if path == "/v1/embeddings":
            got = torch.tensor([item["embedding"] for item in answer["data"]])
            expected = torch.stack([embedding[t] for t in body["input"]])
            diff = (got - expected).abs().max().item()
            assert diff <= MAX_ABS_DIFF_FP32, f"embeddings differ by {diff:.2e}: {body}"
        elif path == "/tokenize":
            assert answer["tokens"] == tokens[body["prompt"]]
        else:
            query = body.get("queries", body.get("query"))
            expected = [o.outputs.score for o in llm_fp32.score(query, body["documents"], use_tqdm=False)]  # fmt: skip
            if path == "/score":
                got = [item["score"] for item in answer["data"]]
            else:  # rerank: best first; compare each document's score by its index
                got = [0.0] * len(expected)
                for result in answer["results"]:
                    got[result["index"]] = result["relevance_score"]
                ranked = [r["relevance_score"] for r in answer["results"]]
                assert ranked == sorted(ranked, reverse=True)
            assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) <= MAX_ABS_DIFF_FP32
    assert httpx.get(f"{default_server.url}/health").status_code == 200


# ---- SmolLM2: greedy completions and chats --------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_offline() -> LLM:
    from factories.smollm2 import find_smollm2_gguf

    return LLM(str(find_smollm2_gguf()), dtype="float32", num_threads=2)


def test_greedy_generation_under_load_is_token_identical(smollm2_server, smollm2_offline: LLM):
    prompts = _texts(16, seed=7)
    rng = random.Random(8)
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    requests = []
    for i in range(NUM_GENERATION_REQUESTS):
        prompt = rng.choice(prompts)
        if i % 2:
            requests.append(("/v1/completions", {"prompt": prompt, **greedy}))
        else:
            messages = [{"role": "user", "content": prompt}]
            requests.append(("/v1/chat/completions", {"messages": messages, **greedy}))
    answers = asyncio.run(_send_all(smollm2_server.url, requests, GENERATION_CONCURRENCY))

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completion = smollm2_offline.generate(prompts, params, use_tqdm=False)
    chat = smollm2_offline.chat([[{"role": "user", "content": p}] for p in prompts], params)
    expected = {
        ("/v1/completions", p): c.outputs[0] for p, c in zip(prompts, completion, strict=True)
    } | {("/v1/chat/completions", p): c.outputs[0] for p, c in zip(prompts, chat, strict=True)}
    for (path, body), answer in zip(requests, answers, strict=True):
        prompt = body.get("prompt") or body["messages"][0]["content"]
        want = expected[(path, prompt)]
        choice = answer["choices"][0]
        assert choice["token_ids"] == want.token_ids, f"{path} {prompt!r}"
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert text == want.text
    assert httpx.get(f"{smollm2_server.url}/health").status_code == 200
