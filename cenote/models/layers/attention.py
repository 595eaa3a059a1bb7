"""Attention over a flat, unpadded token stream: bidirectional (encoders) or causal + paged KV."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cenote.forward_context import AttentionMetadata, get_attention_metadata
from cenote.kernels import ops
from cenote.models.layers.attention_plan import PagedPlan, paged_plan
from cenote.models.layers.torch_varlen import varlen_applies, varlen_attention
from cenote.models.layers.triton_attention import triton_paged_decode

# Encoders only: ``mask_fn(rows, num_requests, length)`` -> a bool (True = attend) or additive
# float mask broadcastable to [num_requests, heads, length, length] for the equal-length requests
# whose tokens are ``rows`` of the flat stream (relative position bias, local window, key mask),
# or None where every token sees every other.
EncoderMaskFn = Callable[[slice, int, int], torch.Tensor | None]


class Attention(nn.Module):
    """Scaled dot-product attention of one layer; holds no weights.

    ``forward(q, k, v)`` takes ``[num_tokens, heads * head_dim]`` projections of the new tokens of
    every request in the step and returns ``[num_tokens, num_heads * head_dim]``.

    ``sliding_window``: a query sees only keys fewer than this many positions away (causal: itself
    and the ``sliding_window - 1`` before it; bidirectional: as far on either side).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma).
    ``causal``: overrides the step's causal flag without a KV cache (a causal trunk served as an
    encoder); None follows the step.
    ``alibi_slopes``: one per head (bidirectional encoders only, JinaBERT): scores gain
    ``-slope * |query position - key position|``, inside the varlen kernel (a bias per request
    where it does not run), never as a mask over the whole step.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        layer_idx: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        causal: bool | None = None,
        alibi_slopes: list[float] | None = None,
    ) -> None:
        super().__init__()
        if alibi_slopes is not None and (
            len(alibi_slopes) != num_heads or causal or sliding_window or softcap
        ):
            raise ValueError(
                f"ALiBi needs one slope per head ({num_heads}, got {len(alibi_slopes)}) and "
                "bidirectional attention without a sliding window or softcap"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.causal = causal
        # fp32 on the host (explicitly: a ``meta`` build keeps it), not a buffer: ``to_empty``
        # and ``.to(dtype)`` of the model leave it alone
        self.alibi_slopes = (
            None if alibi_slopes is None else torch.tensor(alibi_slopes, device="cpu")
        )
        ops.load()  # build or load the kernels with the model, not on its first request

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask_fn: EncoderMaskFn | None = None,
    ) -> torch.Tensor:
        metadata = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if metadata.kv_caches is None:
            causal = metadata.causal if self.causal is None else self.causal
            starts = metadata.query_start_loc[:-1]
            out = self._attend_fresh(q, k, v, starts, metadata.query_lens, causal, mask_fn)
        else:
            assert self.alibi_slopes is None  # ALiBi layers are encoders': no KV cache
            out = self._attend_paged(q, k, v, metadata)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]
        out = self._kernel(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal and mask is None
        )
        return out.transpose(1, 2)  # [batch, q_len, heads, head_dim]

    def _kernel(
        self,
        q: torch.Tensor,  # [batch, heads, q_len, dim]
        k: torch.Tensor,  # [batch, kv_heads, kv_len, dim]
        v: torch.Tensor,
        mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcastable to scores
        causal: bool,  # top-left aligned causal mask (q_len == kv_len), only without ``mask``
    ) -> torch.Tensor:
        """SDPA, or with ``softcap`` the same attention written out (SDPA cannot cap scores)."""
        if mask is not None:
            mask = mask.to(q.device)  # models build their masks on the host; a no-op there
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [batch, heads, q, kv]
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    def _attend_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        causal: bool,
        mask_fn: EncoderMaskFn | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Requests whose new rows [start, start + length) are their whole sequence, each
        attending to its own rows, into ``out`` (allocated when None): one kernel call for all of
        them; where the kernel does not apply, one SDPA call per run of adjacent equal-length
        requests."""
        if out is None:
            out = torch.empty_like(q)
            out[starts[-1] + lengths[-1] if lengths else 0 :].zero_()  # the batch's padding rows
        plain = (
            mask_fn is None
            and self.softcap is None
            and (self.sliding_window is None or max(lengths) <= self.sliding_window)
        )
        alibi = self.alibi_slopes
        if plain:
            if (
                alibi is None
                and varlen_applies(q)
                and self._attend_torch_varlen(q, k, v, starts, lengths, causal, out)
            ):
                return out
            ops.varlen_attention(q, k, v, out, starts, lengths, self.scale, causal, alibi)
            return out
        i = 0
        while i < len(lengths):
            n, j = lengths[i], i
            while j + 1 < len(lengths) and lengths[j + 1] == n and starts[j + 1] == starts[j] + n:
                j += 1
            group = slice(starts[i], starts[j] + n)
            shape = (j - i + 1, n)
            out[group] = self._sdpa(
                q[group].view(*shape, self.num_heads, self.head_dim),
                k[group].view(*shape, self.num_kv_heads, self.head_dim),
                v[group].view(*shape, self.num_kv_heads, self.head_dim),
                causal=causal,
                mask=self._mask(group, j - i + 1, n, causal, mask_fn, q.dtype),
            ).reshape(group.stop - group.start, self.num_heads, self.head_dim)
            i = j + 1
        return out

    def _attend_torch_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        causal: bool,
        out: torch.Tensor,
    ) -> bool:
        """torch's varlen attention over adjacent requests (CUDA), into ``out``; False where
        the requests are not one run of rows or this torch cannot express the call."""
        first, end = starts[0], starts[-1] + lengths[-1]
        if end - first != sum(lengths):  # decode rows between the prompts of a mixed step
            return False
        plans = get_attention_metadata().plans
        key = ("torch_varlen", first, tuple(lengths))
        cu_seq = plans.get(key)
        if cu_seq is None:  # one host -> device copy per step, shared by the layers
            offsets = [0, *itertools.accumulate(lengths)]
            cu_seq = plans[key] = torch.tensor(offsets, dtype=torch.int32, device=q.device)
        rows = slice(first, end)
        result = varlen_attention(
            q[rows], k[rows], v[rows], cu_seq, max(lengths), self.scale, causal
        )
        if result is None:
            return False
        out[rows] = result
        return True

    def _mask(
        self,
        rows: slice,
        num_requests: int,
        length: int,
        causal: bool,
        mask_fn: EncoderMaskFn | None,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The mask of a run of ``num_requests`` equal-length requests: ``mask_fn``'s, the
        ALiBi bias [heads, length, length] or the sliding window's."""
        if mask_fn is not None:
            assert self.alibi_slopes is None  # models with ALiBi pass no other mask
            return mask_fn(rows, num_requests, length)
        if self.alibi_slopes is not None:
            positions = torch.arange(length, dtype=torch.float32)
            distance = (positions.unsqueeze(0) - positions.unsqueeze(1)).abs()  # [length, length]
            return (distance * -self.alibi_slopes.view(-1, 1, 1)).to(dtype)
        return self._window_mask(length, causal)

    def _window_mask(self, length: int, causal: bool) -> torch.Tensor | None:
        """[length, length] bool (True = attend) of a sliding-window layer's request of
        ``length`` tokens, or None where the window does not bite."""
        window = self.sliding_window
        if window is None or length <= window:
            return None
        positions = torch.arange(length)
        distance = positions.unsqueeze(1) - positions.unsqueeze(0)  # query - key
        mask = distance < window if causal else distance.abs() < window
        return mask & (distance >= 0) if causal else mask

    def _attend_paged(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Write the new keys/values of every row into their slots first, then attend: decode
        rows over their blocks in place, whole prompts from their new rows, chunks after cached
        context over their blocks (so a block cached by one request this step is complete)."""
        assert metadata.kv_caches is not None and metadata.slot_mapping is not None  # cached step
        kv_cache = metadata.kv_caches[self.layer_idx]  # see kv_cache_shape
        slots = kv_cache.view(2, self.num_kv_heads, -1, self.head_dim)  # [2, kv_heads, slots, dim]
        slots[0].index_copy_(1, metadata.slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
        slots[1].index_copy_(1, metadata.slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))

        plan = paged_plan(metadata, self.sliding_window)
        if plan.all_decode:
            return self._attend_decode(q, kv_cache, plan)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._attend_decode(q[plan.decode_rows], kv_cache, plan)
        if plan.fresh_starts:
            self._attend_fresh(q, k, v, plan.fresh_starts, plan.fresh_lengths, True, out=out)
        for prefill in plan.prefills:
            kv = ops.gather_blocks(kv_cache, prefill.blocks)[:, :, 0, : prefill.seq_len]
            query = q[prefill.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            result = self._kernel(  # keys, values: [1, kv_heads, seq_len, dim]
                query, kv[0].unsqueeze(0), kv[1].unsqueeze(0), prefill.mask, causal=False
            )
            out[prefill.rows] = result[0].transpose(0, 1)
        return out

    def _attend_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: PagedPlan
    ) -> torch.Tensor:
        """One-token queries of many requests at once: a kernel reads each request's blocks in
        place (the C++ one on the CPU, the Triton one on CUDA); without one, a gather of the
        padded block tables."""
        assert plan.decode_tables is not None  # a plan with decode rows has all three
        assert plan.decode_starts is not None and plan.decode_ends is not None
        if q.device.type == "cuda" and q.dtype == kv_cache.dtype:
            paged_decode = triton_paged_decode()
            if paged_decode is not None:
                return paged_decode(
                    q,
                    kv_cache,
                    plan.decode_tables,
                    plan.decode_starts,
                    plan.decode_ends,
                    self.scale,
                    self.softcap or 0.0,
                )
        return ops.paged_attention(
            q,
            kv_cache,
            plan.decode_tables,
            plan.decode_starts,
            plan.decode_ends,
            self.scale,
            self.softcap,
            # a device's fallback shares the step's mask across layers (the host's kernel
            # needs none)
            key_padding=plan.decode_padding if q.device.type != "cpu" else None,
        )


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """One layer's KV cache: [2 (keys, values), kv_heads, num_blocks, block_size, head_dim].

    Heads outermost: gathering a request's blocks yields [kv_heads, tokens, dim] ready for the
    attention matmuls without another copy."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)
