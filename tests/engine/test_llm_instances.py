"""Several ``LLM`` instances in one process (issue 29, item 6): an embedder and a chat model side
by side share the one kernel library build and torch's thread pool, change no process setting,
and answer exactly as each does alone, called in turn or from two threads at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cenote import SamplingParams, kernels
from tests.factories.decoders import make_decoder
from tests.factories.generation import make_llm, random_prompts, token_prompts

TEXTS = ["a cat sleeps on the mat", "stock markets fell today", "how do plants grow?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory: pytest.TempPathFactory):
    folder = Path(tmp_path_factory.mktemp("llama"))
    make_decoder(folder, "llama")
    return make_llm(folder)


def _embeddings(llm) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])


def _tokens(llm) -> list[list[int]]:
    prompts = token_prompts(random_prompts([5, 9, 3], seed=2))
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


def test_two_instances_share_the_kernels_and_the_threads(llm_fp32, chat_llm) -> None:
    threads = torch.get_num_threads()
    alone_embed, alone_tokens = _embeddings(llm_fp32), _tokens(chat_llm)
    # in turn: each answer is the instance's own, bit for bit
    for _ in range(2):
        assert torch.equal(_embeddings(llm_fp32), alone_embed)
        assert _tokens(chat_llm) == alone_tokens
    # the library was built (or loaded) once for the process, whichever instance asked first
    if not kernels.kernels_disabled():
        assert kernels.build._load_library.cache_info().misses == 1
    assert torch.get_num_threads() == threads


def test_two_instances_called_from_two_threads(llm_fp32, chat_llm) -> None:
    """An embedder and a chat model driven by two Python threads at once: each engine runs its
    own steps (on torch's one intra-op pool), answers as alone, and neither call fails."""
    alone_embed, alone_tokens = _embeddings(llm_fp32), _tokens(chat_llm)
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(name: str, call) -> None:
        try:
            results[name] = [call() for _ in range(3)]
        except BaseException as e:  # reported below with the thread's name
            errors.append(e)

    workers = [
        threading.Thread(target=run, args=("embed", lambda: _embeddings(llm_fp32))),
        threading.Thread(target=run, args=("chat", lambda: _tokens(chat_llm))),
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not errors, errors
    assert all(torch.allclose(e, alone_embed, atol=1e-6) for e in results["embed"])
    assert all(tokens == alone_tokens for tokens in results["chat"])
