"""A request's embedding is the same alone and inside a batch (fp32: max abs diff <= 1e-5)."""

from __future__ import annotations

import random

import pytest
import torch
from factories.texts import PARITY_TEXTS, embed_matrix

MAX_ABS_DIFF_FP32 = 1e-5  # DESIGN.md §3
NUM_TEXTS = 64


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """64 mixed-length texts: the parity corpus, then prose slices of seeded lengths (some
    equal lengths, so requests share attention calls inside the batch)."""
    words = " ".join(PARITY_TEXTS[-9:-5]).split()
    rng = random.Random(0)
    extra = []
    while len(PARITY_TEXTS) + len(extra) < NUM_TEXTS:
        start, n = rng.randrange(len(words)), rng.choice([3, 3, 12, 40, 90])
        extra.append(" ".join((words * 2)[start : start + n]))
    return [*PARITY_TEXTS, *extra][:NUM_TEXTS]


def test_alone_equals_in_batch(llm_fp32, texts) -> None:
    lengths = [
        len(out.prompt_token_ids) for out in llm_fp32.encode(texts, truncate_prompt_tokens=-1)
    ]
    assert len(set(lengths)) > 20, "texts must have mixed lengths"
    assert len(set(lengths)) < len(lengths), "some lengths must repeat"
    # the batch must run as one step, or it would not test batching
    assert sum(lengths) <= llm_fp32.config.scheduler.max_num_batched_tokens
    assert len(texts) <= llm_fp32.config.scheduler.max_num_seqs

    alone = torch.cat([embed_matrix(llm_fp32, [t], truncate_prompt_tokens=-1) for t in texts])
    batched = embed_matrix(llm_fp32, texts, truncate_prompt_tokens=-1)
    order = list(range(len(texts)))
    random.Random(1).shuffle(order)
    shuffled = embed_matrix(llm_fp32, [texts[i] for i in order], truncate_prompt_tokens=-1)
    unshuffled = torch.empty_like(shuffled)
    unshuffled[order] = shuffled

    for name, result in (("batch", batched), ("shuffled batch", unshuffled)):
        diff = (result - alone).abs().amax(dim=-1)
        worst = int(diff.argmax())
        assert diff.max() <= MAX_ABS_DIFF_FP32, (
            f"{name}: text {worst} ({lengths[worst]} tokens) differs by {diff.max():.2e}"
        )
