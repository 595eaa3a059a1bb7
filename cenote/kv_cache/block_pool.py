"""The pool of KV blocks: reference counts, the LRU free queue and the prefix-cache map.

There is no reserved null block: all ``num_blocks`` blocks (ids ``0 .. num_blocks - 1``) can
be handed out. A free block (``ref_cnt == 0``) may still hold cached content; it stays findable
by hash until it is popped for reuse, which evicts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cenote.kv_cache.hashing import BlockHash

if TYPE_CHECKING:
    from cenote.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    """One block of ``block_size`` KV slots (compared by identity)."""

    block_id: int  # index into the KV cache tensors
    ref_cnt: int = 0  # number of requests using the block; 0 = free
    block_hash: BlockHash | None = None  # set while the block is in the prefix-cache map
    prev_free: KVCacheBlock | None = None  # free-queue link (None when not queued)
    next_free: KVCacheBlock | None = None  # free-queue link (None when not queued)

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first (LRU).

    ``popleft``, ``remove`` and ``append`` are O(1). Links live on the blocks themselves,
    between two sentinel blocks, so no per-operation allocation happens.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(block_id=-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in the queue."""
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, f"{block} is not free"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (for tests and debugging)."""
        blocks = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """Hands out blocks, takes them back, and remembers full blocks by hash for reuse.

    Invariants: a block is in the free queue iff ``ref_cnt == 0``; a block has a
    ``block_hash`` iff the prefix-cache map points at it. One block per hash: a second block
    computed with the same content (two requests missing at once) simply stays uncached.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not): what ``get_new_blocks`` can return."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding content ``block_hash``, or ``None`` (does not touch it)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` free blocks in LRU order with ``ref_cnt`` 1, evicting their
        cached content. Raises ``ValueError`` if fewer are free (nothing is popped then)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block. Blocks reaching 0 join the free queue in the order
        given (first given = evicted first) and keep their cached content."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock | None],  # None: freed behind a sliding window
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Record ``blocks[num_cached_blocks:num_full_blocks]`` under the request's block hashes.

        ``request.block_hashes`` must cover ``num_full_blocks`` blocks. Blocks already cached
        (prefix hits) are skipped; a hash already mapped to another block is left alone.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
            f"{num_full_blocks} full blocks"
        )
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], request.block_hashes[i]
            assert block is not None, "only blocks already cached slide out of the window"
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} reused with other content"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content. Only possible when no block is in use (e.g. after a
        weight update); returns False and changes nothing otherwise."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Remove ``block``'s content from the prefix-cache map, if it has any."""
        if block.block_hash is None:
            return
        cached = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert cached is block, f"hash map out of sync for {block}"
        block.block_hash = None
