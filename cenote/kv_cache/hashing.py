"""Chained block hashes: the identity of a full KV block for prefix caching.

A block's hash covers its parent's hash, its own token ids and optional extra keys, so two
blocks hash equal only if the whole prefix up to and including them is equal. Hashes are
SHA-256 digests of a fixed byte encoding: stable across processes and Python hash seeds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cenote.request import Request

BlockHash = bytes  # 32-byte SHA-256 digest of (parent hash, token ids, extra keys)

# Parent of the first block of every sequence.
ROOT_HASH: BlockHash = hashlib.sha256(b"cenote-kv-root").digest()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one block of tokens, chained onto ``parent_hash`` (``None`` for the first block).

    ``extra_keys`` (e.g. a cache salt or adapter name) must have a deterministic ``repr``
    (ints, strs, bytes, tuples of these); requests with different keys never share blocks.
    """
    digest = hashlib.sha256()
    digest.update(ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys is not None:
        encoded = repr(extra_keys).encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return digest.digest()


def compute_block_hashes(
    request: Request, block_size: int, extra_keys: tuple[object, ...] | None = None
) -> list[BlockHash]:
    """Extend ``request.block_hashes`` with the hashes of its newly full blocks.

    Contract: after the call, ``len(request.block_hashes) == request.num_tokens // block_size``
    and hash ``i`` covers ``all_token_ids[: (i + 1) * block_size]``. Only blocks not hashed
    before are hashed (cheap to call every step). Returns the hashes added by this call.
    ``extra_keys`` defaults to the request's own (``Request.block_hash_keys``: its adapter).
    """
    if extra_keys is None:
        extra_keys = request.block_hash_keys
    num_hashed = len(request.block_hashes)
    num_full_blocks = request.num_tokens // block_size
    if num_full_blocks <= num_hashed:
        return []
    token_ids = _token_slice(request, num_hashed * block_size, num_full_blocks * block_size)
    parent = request.block_hashes[-1] if num_hashed else None
    new_hashes: list[BlockHash] = []
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        new_hashes.append(parent)
    request.block_hashes.extend(new_hashes)
    return new_hashes


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]
