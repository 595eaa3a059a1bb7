# mypy: allow-untyped-defs, allow-incomplete-defs
"""The Triton kernel of ``triton_attention.paged_decode`` (see there), in a module of its own:
Triton reads the kernel's globals (``tl``) when it compiles or interprets it, and decides
between the two when the kernel is decorated, so this module is imported on first use, after
``TRITON_INTERPRET`` is set where it is wanted. Its parameters carry no annotations: Triton
reads them as types (only ``tl.constexpr`` may be written)."""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def paged_decode_kernel(  # noqa: PLR0913  (a kernel takes its tensors' strides one by one)
    q_ptr,
    kv_ptr,
    tables_ptr,
    starts_ptr,
    ends_ptr,
    out_ptr,
    scale,
    softcap,
    stride_q_row,
    stride_q_head,
    stride_kv_half,
    stride_kv_head,
    stride_kv_block,
    stride_kv_pos,
    stride_table_row,
    stride_out_row,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + dims, mask=dim_ok, other=0.0)
    q = q.to(tl.float32)
    start = tl.load(starts_ptr + row)
    end = tl.load(ends_ptr + row)
    keys_base = kv_ptr + kv_head * stride_kv_head
    values_base = keys_base + stride_kv_half
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE_SIZE):
        positions = tile_start + tl.arange(0, TILE_SIZE)
        valid = positions < end
        blocks = tl.load(
            tables_ptr + row * stride_table_row + positions // BLOCK_SIZE, mask=valid, other=0
        )
        offsets = blocks * stride_kv_block + (positions % BLOCK_SIZE) * stride_kv_pos
        tile_mask = valid[:, None] & dim_ok[None, :]
        keys = tl.load(keys_base + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        scores = tl.sum(keys.to(tl.float32) * q[None, :], axis=1) * scale  # [TILE]
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh from exp (no libdevice)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max)  # the tile's first position is valid: no NaN
        values = tl.load(values_base + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        acc = acc * rescale + tl.sum(probs[:, None] * values.to(tl.float32), axis=0)
        running_sum = running_sum * rescale + tl.sum(probs, axis=0)
        running_max = new_max
    out = acc / running_sum
    out_at = out_ptr + row * stride_out_row + head * stride_out_head + dims
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
