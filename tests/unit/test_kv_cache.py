"""Unit tests for the paged KV cache bookkeeping (no model, no tensors)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cenote.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from cenote.kv_cache.hashing import compute_block_hashes, hash_block_tokens
from cenote.kv_cache.manager import KVCacheManager, num_blocks_for_memory, num_blocks_per_request
from cenote.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=None,
        pooling_params=None,
    )


def make_manager(num_blocks: int = 10, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BLOCK_SIZE, enable_caching=enable_caching)


def schedule_prompt(manager: KVCacheManager, request: Request) -> list[KVCacheBlock] | None:
    """What the scheduler does on a request's first step: look up, allocate, advance."""
    computed, num_computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_computed
    new_blocks = manager.allocate_slots(request, num_new, computed, num_computed)
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def assert_pool_consistent(manager: KVCacheManager) -> None:
    pool = manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks
    assert all(block.ref_cnt == 0 for block in free)
    free_ids = {block.block_id for block in free}
    assert all(b.ref_cnt > 0 for b in pool.blocks if b.block_id not in free_ids)
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


# ---- hashing -------------------------------------------------------------------------------


def test_hashes_deterministic_and_chained() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, (1, 2, 3, 4))
    assert len(first) == 32
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != first
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first


def test_hashes_stable_across_processes() -> None:
    code = (
        "from cenote.kv_cache.hashing import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6], ('a', 1)).hex())"
    )
    expected = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6], ("a", 1)).hex()
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == expected


def test_compute_block_hashes_incremental() -> None:
    request = make_request("a", list(range(10)))
    added = compute_block_hashes(request, BLOCK_SIZE)
    assert len(added) == 2 and request.block_hashes == added
    assert compute_block_hashes(request, BLOCK_SIZE) == []
    request.append_output_token_ids([10, 11])  # crosses into a third full block
    added = compute_block_hashes(request, BLOCK_SIZE)
    assert len(added) == 1 and len(request.block_hashes) == 3
    fresh = make_request("b", list(range(12)))
    compute_block_hashes(fresh, BLOCK_SIZE)
    assert fresh.block_hashes == request.block_hashes
    assert request.block_hashes[1] == hash_block_tokens(request.block_hashes[0], [4, 5, 6, 7])


# ---- free queue ----------------------------------------------------------------------------


def test_free_block_queue_order() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 2, 3]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.append(blocks[1])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 3, 0, 1]
    assert queue.num_free_blocks == 4
    for _ in range(4):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_block_pool_get_new_blocks_too_many() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3


# ---- manager -------------------------------------------------------------------------------


def test_allocate_and_free_no_leak() -> None:
    manager = make_manager(10)
    requests = [make_request(f"r{i}", [i * 100 + j for j in range(9)]) for i in range(3)]
    for request in requests:
        assert len(schedule_prompt(manager, request)) == 3
        assert manager.get_num_blocks(request.request_id) == 3
    assert manager.num_free_blocks == 1
    assert manager.usage == pytest.approx(0.9)
    ids = [i for r in requests for i in manager.get_block_ids(r.request_id)]
    assert len(set(ids)) == 9
    for request in requests:
        manager.free(request)
        manager.free(request)  # idempotent
    assert manager.num_free_blocks == 10 and manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.get_block_ids("r0") == []
    assert_pool_consistent(manager)


def test_allocate_returns_none_without_partial_allocation() -> None:
    manager = make_manager(4)
    first = make_request("a", list(range(9)))  # 3 blocks
    schedule_prompt(manager, first)
    second = make_request("b", list(range(100, 108)))  # needs 2, only 1 free
    assert manager.allocate_slots(second, 8) is None
    assert manager.num_free_blocks == 1
    assert manager.get_num_blocks("b") == 0 and "b" not in manager.req_to_blocks
    assert manager.allocate_slots(second, 4) is not None  # a chunk that fits
    assert manager.num_free_blocks == 0
    assert_pool_consistent(manager)


def test_prefix_hit_shares_blocks_and_leaves_one_token() -> None:
    manager = make_manager(10)
    prompt = list(range(12))  # exactly 3 full blocks
    first = make_request("a", prompt)
    schedule_prompt(manager, first)
    second = make_request("b", prompt)
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8  # capped: last block recomputed so one token is left
    assert [b.block_id for b in computed] == manager.get_block_ids("a")[:2]
    new_blocks = manager.allocate_slots(second, 4, computed, num_computed)
    assert len(new_blocks) == 1
    assert [b.ref_cnt for b in computed] == [2, 2]
    assert new_blocks[0].ref_cnt == 1
    third = make_request("c", prompt + [99])
    assert manager.get_computed_blocks(third)[1] == 12  # all 3 full blocks hit
    manager.free(first)
    assert [b.ref_cnt for b in computed] == [1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 10
    assert_pool_consistent(manager)


def test_different_early_token_breaks_the_chain() -> None:
    manager = make_manager(10)
    schedule_prompt(manager, make_request("a", list(range(13))))
    changed = list(range(13))
    changed[1] = 999  # block 0 differs; blocks 1 and 2 have identical tokens
    assert manager.get_computed_blocks(make_request("b", changed)) == ([], 0)
    changed = list(range(13))
    changed[5] = 999  # block 1 differs: only block 0 hits
    computed, num_computed = manager.get_computed_blocks(make_request("c", changed))
    assert num_computed == 4 and computed[0].block_id == manager.get_block_ids("a")[0]


def test_free_cached_block_is_reused_by_hit() -> None:
    manager = make_manager(4)
    first = make_request("a", list(range(9)))
    schedule_prompt(manager, first)
    manager.free(first)
    second = make_request("b", list(range(9)))
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8 and all(b.ref_cnt == 0 for b in computed)
    # 4 free blocks, 2 of them are the hits: the request needs 1 more -> fits.
    assert len(manager.allocate_slots(second, 1, computed, num_computed)) == 1
    assert manager.num_free_blocks == 1
    assert_pool_consistent(manager)


def test_free_hits_count_against_free_blocks() -> None:
    manager = make_manager(3)
    first = make_request("a", list(range(9)))
    schedule_prompt(manager, first)
    manager.free(first)
    second = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens, 4 blocks
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8
    assert manager.allocate_slots(second, 5, computed, num_computed) is None
    assert manager.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in computed)
    assert_pool_consistent(manager)


def test_lru_eviction_and_no_stale_hit_after_reuse() -> None:
    manager = make_manager(4)
    first = make_request("a", list(range(8)))  # blocks hashed [0..3], [4..7]
    schedule_prompt(manager, first)
    head_id, tail_id = manager.get_block_ids("a")
    manager.free(first)
    # Free order: the 2 never-used blocks, then a's tail, then a's head.
    order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert order[2:] == [tail_id, head_id]
    filler = make_request("f", list(range(500, 512)))  # 3 blocks: evicts a's tail only
    schedule_prompt(manager, filler)
    assert tail_id in manager.get_block_ids("f") and head_id not in manager.get_block_ids("f")
    again = make_request("b", list(range(8)) + [1])
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 4 and computed[0].block_id == head_id  # the tail was evicted
    assert len(manager.block_pool.cached_block_hash_to_block) == 4  # a's head + f's 3 blocks
    manager.free(filler)
    assert_pool_consistent(manager)


def test_decode_growth_across_block_boundaries() -> None:
    manager = make_manager(10)
    request = make_request("a", list(range(6)))
    schedule_prompt(manager, request)
    assert manager.get_num_blocks("a") == 2
    for step in range(7):  # 6 prompt + 7 decode positions computed -> 13 tokens, 4 blocks
        request.append_output_token_ids([1000 + step])
        new_blocks = manager.allocate_slots(request, 1)
        assert new_blocks is not None
        expected_new = 1 if request.num_computed_tokens % BLOCK_SIZE == 0 else 0
        assert len(new_blocks) == expected_new
        request.num_computed_tokens += 1
    assert manager.get_num_blocks("a") == 4
    assert len(request.block_hashes) == 3  # 13 tokens -> 3 full blocks
    assert len(manager.block_pool.cached_block_hash_to_block) == 3
    other = make_request("b", request.all_token_ids + [7])
    assert manager.get_computed_blocks(other)[1] == 12  # decode tokens are cached too


def test_prefix_cache_stats() -> None:
    manager = make_manager(10)
    schedule_prompt(manager, make_request("a", list(range(10))))
    schedule_prompt(manager, make_request("b", list(range(10))))
    assert manager.queries == 20 and manager.hits == 8
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert manager.make_prefix_cache_stats().queries == 0  # interval reset
    assert manager.queries == 20  # totals kept


def test_caching_disabled() -> None:
    manager = make_manager(10, enable_caching=False)
    schedule_prompt(manager, make_request("a", list(range(10))))
    assert manager.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.queries == 0


def test_reset_prefix_cache() -> None:
    manager = make_manager(10)
    first = make_request("a", list(range(10)))
    schedule_prompt(manager, first)
    assert manager.reset_prefix_cache() is False  # blocks still in use
    manager.free(first)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


def test_num_blocks_for_memory() -> None:
    # 2 (K, V) * 2 layers * 16 slots * 4 heads * 8 dims * 2 bytes = 4096 bytes per block.
    assert num_blocks_for_memory(40_000, 2, 4, 8, 16, torch.bfloat16) == 9
    assert num_blocks_for_memory(40_000, 2, 4, 8, 16, torch.float32) == 4
    assert num_blocks_for_memory(100, 2, 4, 8, 16, torch.float32) == 0


def test_num_blocks_per_request() -> None:
    assert num_blocks_per_request(256, 16, None, 8192) == 16  # every block of max_model_len
    assert num_blocks_per_request(250, 16, None, 8192) == 16
    # a window frees the blocks behind it: window + one chunk (+1 straddling), never more
    # than without it (a whole-prompt chunk holds every block anyway)
    assert num_blocks_per_request(256, 16, 32, 16) == 4  # ceil((31 + 16) / 16) + 1
    assert num_blocks_per_request(256, 16, 32, 8192) == 16
    assert num_blocks_per_request(40, 4, 8, 5) == 4  # ceil((7 + 5) / 4) + 1


def test_duplicate_content_stays_uncached_and_evicts_cleanly() -> None:
    manager = make_manager(4)
    first, second = make_request("a", list(range(8))), make_request("b", list(range(8)))
    for request in (first, second):  # both miss in the same step, then compute the same blocks
        manager.allocate_slots(request, 8)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert all(b.block_hash is None for b in manager.req_to_blocks["b"])
    manager.free(first)
    manager.free(second)
    schedule_prompt(manager, make_request("f", list(range(100, 116))))  # evicts everything
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
    assert_pool_consistent(manager)
