from __future__ import annotations

import math
import os

import pytest
import torch

from cenote.sampling.metadata import SamplingMetadata, SamplingRow, make_generator
from cenote.sampling.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    mask_tokens,
)
from cenote.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 32


def make_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * 3


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    masked: list[int] | None = None,
    **kwargs,
) -> SamplingRow:
    params = SamplingParams(**kwargs)
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        masked_token_ids=masked,
    )


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    metadata = SamplingMetadata.from_rows(rows, vocab_size=logits.shape[-1])
    return Sampler()(logits, metadata)


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = make_logits(4).to(torch.bfloat16)
    before = logits.clone()
    out = run(logits, [make_row(temperature=0.0) for _ in range(4)])
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert torch.equal(logits, before)
    assert out.logprobs is None


def test_mixed_greedy_and_random_rows() -> None:
    logits = make_logits(3)
    rows = [make_row(temperature=0.0), make_row(temperature=1.0, top_k=1), make_row()]
    out = run(logits, rows)
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[1] == logits[1].argmax()  # top_k=1 leaves only the argmax
    assert 0 <= out.sampled_token_ids[2] < VOCAB


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 5]), None)
    inf = float("-inf")
    assert out[0].tolist() == [inf, 5.0, inf, 4.0, inf]
    assert out[1].tolist() == logits[1].tolist()  # k = vocab: off


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    out = apply_top_k_top_p(logits, None, torch.tensor([0.75, 1.0]))
    # row 0: 0.5 + 0.3 = 0.8 >= 0.75 -> keep tokens 1 and 3 only
    assert torch.isinf(out[0, [0, 2]]).all()
    assert torch.allclose(out[0, [1, 3]], logits[0, [1, 3]])
    assert torch.allclose(out[1], logits[1])
    # a tiny p still keeps the most likely token
    tiny = apply_top_k_top_p(logits[:1], None, torch.tensor([1e-6]))
    assert torch.isfinite(tiny).sum() == 1 and torch.isfinite(tiny[0, 1])


def test_top_k_then_top_p_together() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.6]))
    # top-3 renormalised: 0.444, 0.333, 0.222 -> nucleus 0.6 keeps tokens 0 and 1
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_min_p_drops_below_fraction_of_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.4, 0.0]))
    # threshold 0.4 * 0.5 = 0.2 -> keep 0.5 and 0.3
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).all()


def test_temperature_matches_hand_distribution() -> None:
    # Two tokens with logits (0, 1) at temperature 0.5 -> p(1) = sigmoid(2).
    logits = torch.tensor([[0.0, 1.0]]).repeat(4000, 1)
    torch.manual_seed(0)
    out = run(logits, [make_row(temperature=0.5) for _ in range(4000)])
    frequency = out.sampled_token_ids.float().mean().item()
    assert abs(frequency - 1 / (1 + math.exp(-2))) < 0.03


def test_sampling_respects_all_masks() -> None:
    logits = make_logits(200, seed=3)
    rows = [make_row(top_k=3) for _ in range(200)]
    out = run(logits, rows)
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == out.sampled_token_ids.unsqueeze(1)).any(dim=1).all()


def test_seeded_row_is_batch_invariant() -> None:
    logits = make_logits(6, seed=1)
    target = logits[2:3]
    alone = run(target, [make_row(seed=1234, top_p=0.9)]).sampled_token_ids[0]
    for trial in range(3):
        rows = [
            make_row(seed=7 + trial),
            make_row(),
            make_row(seed=1234, top_p=0.9),
            make_row(temperature=0.0),
            make_row(top_k=5),
            make_row(seed=99, min_p=0.1),
        ]
        batched = run(logits, rows).sampled_token_ids[2]
        assert batched == alone


def test_seed_reproducible_across_fresh_generators() -> None:
    logits = make_logits(1, seed=5, vocab=1000) / 10  # flat: many plausible tokens
    draws = [run(logits, [make_row(seed=42)]).sampled_token_ids.item() for _ in range(3)]
    assert len(set(draws)) == 1
    others = {run(logits, [make_row(seed=s)]).sampled_token_ids.item() for s in range(20)}
    assert len(others) > 1


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = make_row(
        prompt=[0, 1],
        output=[3, 3, 4],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        temperature=0.0,
    )
    metadata = SamplingMetadata.from_rows([row], vocab_size=6)
    out = apply_penalties(logits.clone(), metadata)
    expected = [
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5,  # unseen
        3.0 / 2 - 0.5 - 0.25 * 2,  # output twice
        -2.0 * 2 - 0.5 - 0.25 * 1,  # output once
        1.0,  # unseen
    ]
    assert torch.allclose(out[0], torch.tensor(expected))


def test_penalties_per_row_and_padding() -> None:
    logits = make_logits(2, vocab=8)
    rows = [make_row(output=[1, 2, 3], frequency_penalty=1.0), make_row(output=[])]
    metadata = SamplingMetadata.from_rows(rows, vocab_size=8)
    out = apply_penalties(logits.clone(), metadata)
    assert torch.allclose(out[0, [1, 2, 3]], logits[0, [1, 2, 3]] - 1.0)
    assert torch.allclose(out[1], logits[1])


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = run(logits, [make_row(output=[0], temperature=0.0, presence_penalty=2.0)])
    assert out.sampled_token_ids.item() == 1


def test_mask_tokens_bans_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [1.0, 9.0, 2.0]])
    out = run(logits, [make_row(temperature=0.0, masked=[0]), make_row(temperature=0.0)])
    assert out.sampled_token_ids.tolist() == [1, 1]
    banned = mask_tokens(logits.clone(), {1: [1, 99]})
    assert banned[1].tolist() == [1.0, float("-inf"), 2.0]


def test_logprobs_are_raw_log_softmax_with_topk_and_ranks() -> None:
    logits = make_logits(3, seed=9).to(torch.bfloat16)
    rows = [
        make_row(logprobs=3, temperature=0.5, repetition_penalty=1.5, output=[1]),
        make_row(logprobs=1, temperature=0.0),
        make_row(),
    ]
    out = run(logits, rows)
    assert out.logprobs is not None
    expected = torch.log_softmax(logits.float(), dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (3, 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0])
    top = expected.topk(3, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs.logprobs[:, 1:], top.values)
    sorted_ids = expected.argsort(dim=-1, descending=True)
    for i in range(3):
        rank = (sorted_ids[i] == sampled[i]).nonzero().item() + 1
        assert out.logprobs.ranks[i].item() == rank
    assert out.logprobs.ranks[1].item() == 1  # greedy row picks the top token


def test_processors_match_transformers() -> None:
    generation = pytest.importorskip("transformers.generation.logits_process")
    logits = make_logits(2, seed=11)
    seen = torch.tensor([[0, 3, 3, 7], [1, 2, 5, 5]])
    rows = [make_row(prompt=[0, 3], output=[3, 7], repetition_penalty=1.3)]
    rows.append(make_row(prompt=[1, 2, 5], output=[5], repetition_penalty=1.3))
    metadata = SamplingMetadata.from_rows(rows, vocab_size=VOCAB)
    hf = generation.RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    assert torch.allclose(apply_penalties(logits.clone(), metadata), hf)
    for ours, theirs in [
        (apply_top_k_top_p(logits, torch.tensor([5, 5]), None), generation.TopKLogitsWarper(5)),
        (
            apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.7])),
            generation.TopPLogitsWarper(0.7),
        ),
        (apply_min_p(logits, torch.tensor([0.2, 0.2])), generation.MinPLogitsWarper(0.2)),
    ]:
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs(seen, logits.clone())))
    out = run(logits, [make_row(logprobs=2, temperature=0.0)] * 2)
    expected = torch.nn.functional.log_softmax(logits, dim=-1).topk(2).values
    assert torch.allclose(out.logprobs.logprobs[:, 1:], expected)


def test_prompt_logprobs() -> None:
    logits = make_logits(5, seed=2)
    targets = torch.tensor([3, 1, 4, 1, 5])
    result = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert result.token_ids.shape == (5, 3)
    assert torch.equal(result.token_ids[:, 0], targets)
    assert torch.allclose(result.logprobs[:, 0], expected[torch.arange(5), targets])
    assert torch.equal(result.token_ids[:, 1:], expected.topk(2).indices)
    ranks = (expected > expected[torch.arange(5), targets][:, None]).sum(-1) + 1
    assert torch.equal(result.ranks, ranks)


def test_metadata_flags() -> None:
    rows = [make_row(temperature=0.0), make_row(top_p=0.5, seed=3)]
    metadata = SamplingMetadata.from_rows(rows, vocab_size=VOCAB)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.no_penalties and metadata.top_k is None and metadata.top_p is not None
    assert list(metadata.generators) == [1]
    assert metadata.temperature.tolist() == [1.0, 1.0]
    assert metadata.max_num_logprobs is None


def test_empty_batch() -> None:
    metadata = SamplingMetadata.from_rows([], vocab_size=VOCAB)
    out = Sampler()(torch.zeros(0, VOCAB), metadata)
    assert out.sampled_token_ids.shape == (0,)
