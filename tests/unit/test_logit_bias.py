"""OpenAI's ``logit_bias`` in the sampler: a row's bias moves only its own tokens."""

from __future__ import annotations

import pytest
import torch

from cenote.errors import InvalidInputError
from cenote.sampling.metadata import SamplingMetadata, SamplingRow, TokenBias
from cenote.sampling.sampler import Sampler, apply_logit_bias
from cenote.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

VOCAB = 16


def _row(**kwargs) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**kwargs), prompt_token_ids=[1], output_token_ids=[])


def _bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    metadata = SamplingMetadata.from_rows(rows, vocab_size=logits.shape[-1])
    assert metadata.logit_bias is not None
    return apply_logit_bias(logits.clone(), metadata.logit_bias)


def test_apply_logit_bias_adds_per_row_and_ignores_ids_outside_vocab() -> None:
    rows = [_row(), _row(logit_bias={3: 2.5, 7: -1.0, VOCAB + 5: 9.0})]
    expected = torch.zeros(2, VOCAB)
    expected[1, 3], expected[1, 7] = 2.5, -1.0
    assert torch.equal(_bias(torch.zeros(2, VOCAB), rows), expected)


def test_one_scatter_equals_the_per_row_reference() -> None:
    """Many rows with full-sized dicts, some unbiased, some sharing tokens: the batched scatter
    adds exactly what row-by-row indexing adds (the sampler before it was batched)."""
    vocab, generator = 4096, torch.Generator().manual_seed(1)
    logits = torch.randn(9, vocab, generator=generator)
    biases = []
    for i in range(9):
        ids = torch.randperm(vocab, generator=generator)[:MAX_LOGIT_BIAS_ENTRIES].tolist()
        values = (torch.rand(len(ids), generator=generator) * 200 - 100).tolist()
        biases.append(dict(zip(ids, values, strict=True)) if i % 3 else None)
    reference = logits.clone()
    for row, bias in enumerate(biases):
        if bias:
            reference[row, list(bias)] += torch.tensor(list(bias.values()))
    rows = [_row(logit_bias=bias) for bias in biases]
    assert torch.equal(_bias(logits, rows), reference)
    # the runner's tensors, built once per request, give the same batch
    prebuilt = [
        SamplingRow(r.params, [1], [], logit_bias=TokenBias.from_dict(b, vocab) if b else None)
        for r, b in zip(rows, biases, strict=True)
    ]
    assert torch.equal(_bias(logits, prebuilt), reference)


def test_bf16_logits_take_the_bias() -> None:
    logits = torch.zeros(1, VOCAB, dtype=torch.bfloat16)
    out = _bias(logits, [_row(logit_bias={2: 1.5})])
    assert out.dtype == torch.bfloat16 and out[0, 2] == 1.5 and out.sum() == 1.5


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


def test_a_vocabulary_sized_bias_is_refused_with_the_numbers() -> None:
    SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES), 1.0))  # the bound
    with pytest.raises(InvalidInputError, match=r"logit_bias has 49152 entries, at most 300"):
        SamplingParams(logit_bias=dict.fromkeys(range(49152), 1.0))


def test_engine_converts_each_request_bias_once(tmp_path, monkeypatch) -> None:
    """Every step of every completion sharing one bias reuses the request's tensors."""
    from factories.decoders import make_decoder
    from factories.generation import make_llm, random_prompts, token_prompts

    make_decoder(tmp_path, "llama")
    llm = make_llm(tmp_path, block_size=4)
    calls = []
    original = TokenBias.from_dict

    def counting(bias, vocab_size, device="cpu"):
        calls.append(len(bias))
        return original(bias, vocab_size, device)

    params = SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=7, logit_bias={9: 100.0})
    monkeypatch.setattr(TokenBias, "from_dict", staticmethod(counting))
    (out,) = llm.generate(token_prompts(random_prompts([6])), params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [[9] * 5] * 3
    assert calls == [1, 1, 1]  # once per completion, not once per step
