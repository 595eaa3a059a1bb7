"""KV cache manager: which blocks each request owns, and prefix-cache lookups.

The scheduler talks to this class only; it speaks tokens and gets blocks back. The manager
keeps ``request.block_hashes`` up to date itself (see ``compute_block_hashes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cenote.kv_cache.block_pool import BlockPool, KVCacheBlock
from cenote.kv_cache.hashing import compute_block_hashes

if TYPE_CHECKING:
    import torch

    from cenote.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens."""

    requests: int = 0  # number of get_computed_blocks calls with caching on
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates paged KV blocks to requests, with chained-hash prefix caching.

    Per scheduling of request R: ``blocks, n = get_computed_blocks(R)`` (first schedule only),
    then ``allocate_slots(R, num_new_tokens, blocks, n)``; on ``None`` the request cannot run
    now. The scheduler moves ``R.num_computed_tokens`` itself; ``free(R)`` when R finishes or
    is preempted.

    With a ``sliding_window`` (every layer of the model slides), ``allocate_slots`` first frees
    the blocks no query from ``R.num_computed_tokens`` on can see; their places in the block
    table become ``None`` (block id -1), which attention never reads.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its blocks in token order; None where a block left the sliding window
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.num_skipped_blocks: dict[str, int] = {}  # request id -> leading blocks freed
        self.num_cached_blocks: dict[str, int] = {}  # request id -> blocks already in the map
        self._total_stats = PrefixCacheStats()  # since start
        self._interval_stats = PrefixCacheStats()  # since the last make_prefix_cache_stats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.block_pool.usage

    @property
    def queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start."""
        return self._total_stats.queries

    @property
    def hits(self) -> int:
        """Tokens served from the prefix cache since start."""
        return self._total_stats.hits

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call (for per-step metrics); resets the interval."""
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return stats

    def get_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request, in token order (empty if it holds none); -1 for blocks
        freed behind the sliding window."""
        blocks = self.req_to_blocks.get(request_id, ())
        return [-1 if block is None else block.block_id for block in blocks]

    def get_num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    # ---- allocation ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's full blocks, and its length in tokens.

        At least one token is always left to compute (the model must produce the last
        position), so at most ``(num_tokens - 1) // block_size`` blocks are returned. The
        blocks are not referenced yet: pass them to ``allocate_slots`` right away.
        """
        if not self.enable_caching:
            return [], 0
        compute_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        for stats in (self._total_stats, self._interval_stats):
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for ``num_computed_tokens + num_new_computed_tokens +
        num_new_tokens`` tokens.

        Returns the newly allocated blocks (possibly empty), or ``None`` with nothing changed
        when too few blocks are free. On success the prefix-hit blocks are referenced and every
        block that these tokens fill is entered into the prefix cache.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        assert not (new_computed_blocks and blocks), "prefix hits only on a request's first step"

        # 0) Sliding window: free the blocks no query from here on can see.
        if self.sliding_window is not None:
            self._free_outside_window(request.request_id, request.num_computed_tokens)

        # 1) Count the blocks needed; cache hits on free blocks take them out of the free pool.
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        # 2) Reference the prefix hits, then take fresh blocks.
        if new_computed_blocks:
            assert self.enable_caching, "prefix hits with caching disabled"
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        # 3) Enter the blocks these tokens fill into the prefix cache.
        if self.enable_caching:
            compute_block_hashes(request, self.block_size)
            num_full_blocks = min(num_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full_blocks)
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finished or preempted). Their cached content
        stays reusable; the sequence's tail blocks are evicted first. Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_skipped_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(block for block in reversed(blocks) if block is not None)

    def _free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that end before the window of position
        ``num_computed_tokens`` (the next query); they keep their prefix-cache content."""
        assert self.sliding_window is not None
        blocks = self.req_to_blocks[request_id]
        first_visible = max(0, num_computed_tokens - self.sliding_window + 1)
        end = min(first_visible // self.block_size, len(blocks))
        start = self.num_skipped_blocks.get(request_id, 0)
        if end <= start:
            return
        # cached blocks were entered into the prefix cache when their tokens were allocated
        assert not self.enable_caching or end <= self.num_cached_blocks.get(request_id, 0)
        self.block_pool.free_blocks(b for b in blocks[start:end] if b is not None)
        blocks[start:end] = [None] * (end - start)
        self.num_skipped_blocks[request_id] = end

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V for one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_memory(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """How many whole KV blocks fit in ``budget_bytes`` (0 if none; never negative)."""
    per_block = kv_cache_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    return max(0, budget_bytes // per_block)


def num_blocks_per_request(
    max_model_len: int, block_size: int, sliding_window: int | None, max_chunk_tokens: int
) -> int:
    """KV blocks one request of ``max_model_len`` tokens holds at its peak. Without a sliding
    window: all of them. With one, the blocks behind it are freed as the request advances, so
    it holds the window and one prompt chunk of up to ``max_chunk_tokens`` (the step's token
    budget), plus a block where they straddle block boundaries (vLLM's estimate)."""
    num_blocks = -(-max_model_len // block_size)
    if sliding_window is not None:
        num_tokens = sliding_window - 1 + min(max_chunk_tokens, max_model_len)
        num_blocks = min(num_blocks, -(-num_tokens // block_size) + 1)
    return num_blocks
