"""Attention over a flat, unpadded token stream: bidirectional (encoders) or causal + paged KV."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cenote.forward_context import AttentionMetadata, get_attention_metadata


class Attention(nn.Module):
    """Scaled dot-product attention of one layer; holds no weights.

    ``forward(q, k, v)`` takes ``[num_tokens, heads * head_dim]`` projections of the new tokens of
    every request in the step and returns ``[num_tokens, num_heads * head_dim]``.
    """

    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, layer_idx: int, scale: float
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        metadata = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if metadata.kv_caches is None:
            out = self._attend_without_cache(q, k, v, metadata)
        else:
            out = self._attend_paged(q, k, v, metadata)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, mask=None
    ) -> torch.Tensor:
        # q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.transpose(1, 2)  # [batch, q_len, heads, head_dim]

    def _attend_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Each request sees only its own tokens; requests of equal length share one kernel call."""
        loc = metadata.query_start_loc
        lens = metadata.query_lens
        out = torch.empty_like(q)
        i = 0
        while i < len(lens):
            j = i
            while j + 1 < len(lens) and lens[j + 1] == lens[i]:
                j += 1
            start, end, n = loc[i], loc[j + 1], lens[i]
            group = slice(start, end)
            shape = (j - i + 1, n)
            out[group] = self._sdpa(
                q[group].view(*shape, self.num_heads, self.head_dim),
                k[group].view(*shape, self.num_kv_heads, self.head_dim),
                v[group].view(*shape, self.num_kv_heads, self.head_dim),
                causal=metadata.causal,
            ).reshape(end - start, self.num_heads, self.head_dim)
            i = j + 1
        return out

    def _attend_paged(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Write the new keys/values into their slots, then attend over each request's blocks."""
        kv_cache = metadata.kv_caches[self.layer_idx]  # [2, num_blocks, block_size, kv_heads, dim]
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, k.to(key_cache.dtype))
        value_cache.index_copy_(0, metadata.slot_mapping, v.to(value_cache.dtype))

        out = torch.empty_like(q)
        loc, lens = metadata.query_start_loc, metadata.query_lens
        decode_rows = [i for i, n in enumerate(lens) if n == 1]
        if len(decode_rows) > 1:
            self._attend_decode_batch(q, out, decode_rows, kv_cache, metadata)
            done = set(decode_rows)
        else:
            done = set()
        for i, n in enumerate(lens):
            if i in done:
                continue
            keys, values = self._gather(kv_cache, metadata.block_tables[i], metadata)
            seq_len = metadata.seq_lens[i]
            keys, values = keys[:seq_len], values[:seq_len]
            rows = slice(loc[i], loc[i + 1])
            mask = None
            if n != seq_len and n > 1:  # a chunk after cached context: causal, bottom-right aligned
                positions = torch.arange(seq_len - n, seq_len).unsqueeze(1)
                mask = torch.arange(seq_len).unsqueeze(0) <= positions  # [n, seq_len]
            out[rows] = self._sdpa(
                q[rows].unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                causal=n > 1,
                mask=mask,
            )[0]
        return out

    def _gather(
        self, kv_cache: torch.Tensor, block_table: list[int], metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.tensor(block_table, dtype=torch.long)
        keys = kv_cache[0, blocks].view(-1, self.num_kv_heads, self.head_dim)
        values = kv_cache[1, blocks].view(-1, self.num_kv_heads, self.head_dim)
        return keys, values

    def _attend_decode_batch(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        rows: list[int],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """One-token queries of many requests in one call, keys padded to the longest context."""
        tables = [metadata.block_tables[i] for i in rows]
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor(
            [t + [t[0]] * (max_blocks - len(t)) for t in tables], dtype=torch.long
        )
        keys = kv_cache[0, padded].view(len(rows), -1, self.num_kv_heads, self.head_dim)
        values = kv_cache[1, padded].view(len(rows), -1, self.num_kv_heads, self.head_dim)
        seq_lens = torch.tensor([metadata.seq_lens[i] for i in rows])
        mask = torch.arange(keys.shape[1]).unsqueeze(0) < seq_lens.unsqueeze(1)  # [batch, kv_len]
        token_index = torch.tensor([metadata.query_start_loc[i] for i in rows], dtype=torch.long)
        result = self._sdpa(
            q[token_index].unsqueeze(1), keys, values, causal=False, mask=mask[:, None, None, :]
        )
        out[token_index] = result[:, 0]
