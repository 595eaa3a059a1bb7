"""OpenAI's ``logit_bias`` in the sampler: a row's bias moves only its own tokens."""

from __future__ import annotations

import pytest
import torch

from cenote.sampling.metadata import SamplingMetadata, SamplingRow
from cenote.sampling.sampler import Sampler, apply_logit_bias
from cenote.sampling_params import SamplingParams

VOCAB = 16


def _row(**kwargs) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**kwargs), prompt_token_ids=[1], output_token_ids=[])


def test_apply_logit_bias_adds_per_row_and_ignores_ids_outside_vocab() -> None:
    logits = torch.zeros(2, VOCAB)
    apply_logit_bias(logits, {1: {3: 2.5, 7: -1.0, VOCAB + 5: 9.0}})
    expected = torch.zeros(2, VOCAB)
    expected[1, 3], expected[1, 7] = 2.5, -1.0
    assert torch.equal(logits, expected)


def test_bias_forces_and_bans_tokens_greedy_and_random() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    best = int(logits[0].argmax())
    rows = [
        _row(temperature=0.0, logit_bias={5: 100.0}),  # forced
        _row(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0}),  # best banned
        _row(temperature=1.0, seed=3, logit_bias={9: 100.0}),
    ]
    metadata = SamplingMetadata.from_rows(rows, vocab_size=VOCAB)
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[0] == 5
    assert out.sampled_token_ids[1] != logits[1].argmax()
    assert out.sampled_token_ids[2] == 9
    plain = Sampler()(logits, SamplingMetadata.from_rows([_row(temperature=0.0)], VOCAB))
    assert plain.sampled_token_ids[0] == best  # no bias, no change


@pytest.mark.parametrize(
    ("bias", "message"), [({1: 101.0}, "[-100, 100]"), ({-1: 1.0}, "non-negative")]
)
def test_out_of_range_bias_is_refused(bias, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias)
