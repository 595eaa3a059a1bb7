"""The flat batch of a step: encoder steps are padded at the end to a bounded set of row counts
(oneDNN builds a matmul per distinct row count), decoder steps with a KV cache are not."""

from __future__ import annotations

import torch

from cenote.runner.batch import build_input_batch, padded_rows
from cenote.scheduler.output import ScheduledRequest


def _request(i: int, n: int, start: int = 0, block_ids: list[int] | None = None):
    ids = [100 + i] * n
    return ScheduledRequest(
        request_id=str(i),
        token_ids=ids,
        start_position=start,
        block_ids=block_ids or [],
        prompt_token_ids=ids,
        output_token_ids=[],
        token_type_ids=[1] * n if i == 1 else None,
        sampling_params=None,
        pooling_params=None,
        eos_token_id=None,
        completes_prompt=True,
        needs_sample=False,
    )


def test_padded_row_counts_are_few_and_close() -> None:
    counts = {padded_rows(n, 512) for n in range(1, 8193)}
    assert len(counts) <= 100, f"{len(counts)} distinct row counts up to 8,192 tokens"
    for n in range(1, 8193):
        p = padded_rows(n, 512)
        assert n <= p <= n + max(15, n // 8), f"{n} tokens padded to {p}"
    assert padded_rows(0, 512) == 0


def test_padding_positions_stay_below_the_position_limit() -> None:
    for limit in (1, 2, 7, 16, 40, 100):
        for n in range(1, 300):
            assert padded_rows(n, limit) - n < limit, (n, limit)


def test_encoder_batch_is_padded_with_one_dummy_sequence() -> None:
    scheduled = [_request(0, 5), _request(1, 3), _request(2, 9)]
    batch = build_input_batch(scheduled, 16, None, 512)
    padded = padded_rows(17, 512)
    assert padded > 17
    assert batch.num_tokens == 17 and batch.row_ends == [5, 8, 17]
    assert batch.input_ids.shape == (padded,) and batch.positions.shape == (padded,)
    assert batch.token_type_ids is not None and batch.token_type_ids.shape == (padded,)
    assert batch.positions[17:].tolist() == list(range(padded - 17))
    assert batch.input_ids[17:].eq(0).all() and batch.token_type_ids[17:].eq(0).all()
    assert batch.token_type_ids[5:8].eq(1).all()
    # the requests' rows are unchanged; attention sees only them
    assert batch.attention.query_start_loc == [0, 5, 8, 17]
    assert batch.input_ids[:5].eq(100).all() and batch.positions[:5].tolist() == list(range(5))


def test_decoder_batch_with_a_kv_cache_is_not_padded() -> None:
    caches = [torch.zeros(2, 4, 16, 1, 8)]
    scheduled = [_request(0, 5, block_ids=[1]), _request(2, 1, start=20, block_ids=[2, 3])]
    batch = build_input_batch(scheduled, 16, caches, 512)
    assert batch.num_tokens == 6 and batch.input_ids.shape == (6,)
    assert batch.attention.slot_mapping is not None
    assert batch.attention.slot_mapping.tolist() == [16, 17, 18, 19, 20, 3 * 16 + 4]


def test_no_position_limit_means_no_padding() -> None:
    batch = build_input_batch([_request(0, 5)], 16, None, None)
    assert batch.input_ids.shape == (5,) and batch.num_tokens == 5
