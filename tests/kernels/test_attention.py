"""``Attention`` on random tensors against per-request reference attention, each case through
the C++ kernels and through the Python fallback: encoder batches (plain, key masks, additive
biases, sliding windows, softcap, causal, GQA; a request's rows independent of its batch) and
paged decode (fp32, bf16, GQA, windows, softcap); the kernels' input checks, and the fallback
with a log line when they cannot be built."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch

from cenote.forward_context import AttentionMetadata, forward_context
from cenote.kernels import attention_ops, ops
from cenote.models.layers.attention import Attention, kv_cache_shape
from cenote.models.layers.attention_plan import paged_plan
from cenote.platforms import CpuPlatform

ATOL_FP32 = 1e-5  # DESIGN.md §3: batch invariance, fp32
ATOL_BF16 = 2e-2  # one bf16 rounding of outputs of magnitude ~1
HEADS, KV_HEADS, DIM = 4, 2, 16
BLOCK_SIZE = 4
# mixed lengths, some repeated and not adjacent, one request much longer than the rest
LENGTHS = [5, 17, 5, 1, 33, 17, 2, 9, 120, 9, 5]


def _reference(q, k, v, scale, *, causal=False, window=None, softcap=None, bias=None, keep=None):
    """Dense attention of one request: q [n, heads, dim], k/v [m, kv_heads, dim], queries at
    the last n positions of m; bias [heads, n, m] additive; keep [m] bool visible keys."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n, m = q.shape[0], k.shape[0]
    query_pos = torch.arange(m - n, m).unsqueeze(1)
    distance = query_pos - torch.arange(m).unsqueeze(0)
    allowed = torch.ones(n, m, dtype=torch.bool)
    if causal:
        allowed &= distance >= 0
    if window is not None:
        allowed &= distance.abs() < window
    if keep is not None:
        allowed &= keep.unsqueeze(0)
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _random_stream(lengths, heads=HEADS, kv_heads=KV_HEADS, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads * DIM, generator=generator).to(dtype)
    k = torch.randn(total, kv_heads * DIM, generator=generator).to(dtype)
    v = torch.randn(total, kv_heads * DIM, generator=generator).to(dtype)
    loc = [0]
    for n in lengths:
        loc.append(loc[-1] + n)
    return q, k, v, loc


def _per_request(q, k, v, loc, heads, kv_heads, bias_of=None, keep_all=None, **options):
    """The stream's requests one by one through ``_reference``; [num_tokens, heads * dim]."""
    parts = []
    for i in range(len(loc) - 1):
        rows = slice(loc[i], loc[i + 1])
        parts.append(
            _reference(
                q[rows].view(-1, heads, DIM),
                k[rows].view(-1, kv_heads, DIM),
                v[rows].view(-1, kv_heads, DIM),
                DIM**-0.5,
                bias=None if bias_of is None else bias_of(loc[i + 1] - loc[i]),
                keep=None if keep_all is None else keep_all[rows],
                **options,
            )
        )
    return torch.cat(parts).reshape(q.shape[0], -1).float()


# ---- encoder batches -------------------------------------------------------------------------


@pytest.fixture(params=["kernel", "loop"])
def encoder_path(request) -> Iterator[str]:
    """Run the test through the varlen kernel, then through the Python loop fallback."""
    if request.param == "kernel" and attention_ops() is None:
        pytest.fail("the attention kernels did not build on this machine")
    if request.param == "loop":
        with ops.use_torch():
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(causal=True),
        dict(sliding_window=4),
        dict(sliding_window=4, causal=True),
        dict(sliding_window=200),  # wider than every request: the kernel applies
        dict(softcap=3.0),
        dict(softcap=3.0, sliding_window=6, causal=True),
        dict(kv_heads=1, causal=True),
    ],
    ids=["plain", "causal", "window", "causal-window", "wide-window", "softcap", "all", "gqa"],
)
def test_encoder_batch_matches_per_request_attention(options, encoder_path) -> None:
    causal = options.pop("causal", False)
    kv_heads = options.pop("kv_heads", KV_HEADS)
    q, k, v, loc = _random_stream(LENGTHS, kv_heads=kv_heads)
    attention = Attention(HEADS, DIM, kv_heads, 0, DIM**-0.5, **options)
    with forward_context(AttentionMetadata(loc, LENGTHS, causal=causal)):
        got = attention(q, k, v)
    expected = _per_request(
        q,
        k,
        v,
        loc,
        HEADS,
        kv_heads,
        causal=causal,
        window=options.get("sliding_window"),
        softcap=options.get("softcap"),
    )
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)


def test_encoder_mask_fn_key_mask_and_bias(encoder_path) -> None:
    """``mask_fn`` gets runs of equal-length requests as slices of the stream: a bool key mask
    indexed by row and an additive per-length bias land on the right requests."""
    q, k, v, loc = _random_stream(LENGTHS, heads=HEADS, kv_heads=HEADS, seed=1)
    hidden = torch.rand(loc[-1], generator=torch.Generator().manual_seed(2)) < 0.2
    hidden[torch.tensor(loc[:-1])] = False  # every request keeps a visible key
    visible = ~hidden
    attention = Attention(HEADS, DIM, HEADS, 0, DIM**-0.5)

    def key_mask(rows: slice, num_requests: int, length: int) -> torch.Tensor:
        return visible[rows].view(num_requests, 1, 1, length)

    def relative_bias(length: int) -> torch.Tensor:
        positions = torch.arange(length)
        return (positions[None, :] - positions[:, None]).float().abs().neg().mul(0.3)

    def bias(rows: slice, num_requests: int, length: int) -> torch.Tensor:
        return relative_bias(length).expand(HEADS, length, length)

    metadata = AttentionMetadata(loc, LENGTHS, causal=False)
    with forward_context(metadata):
        masked = attention(q, k, v, key_mask)
        biased = attention(q, k, v, bias)
    expected = _per_request(q, k, v, loc, HEADS, HEADS, keep_all=visible)
    torch.testing.assert_close(masked, expected, atol=ATOL_FP32, rtol=0)
    expected = _per_request(
        q, k, v, loc, HEADS, HEADS, bias_of=lambda n: relative_bias(n).expand(HEADS, n, n)
    )
    torch.testing.assert_close(biased, expected, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_encoder_row_is_independent_of_its_batch(dtype, encoder_path) -> None:
    """A request alone and inside a batch of many (the kernel then spreads requests over the
    threads) gets the same rows: bit for bit, each request is SDPA's on it alone."""
    lengths = LENGTHS * 4
    q, k, v, loc = _random_stream(lengths, seed=3, dtype=dtype)
    attention = Attention(HEADS, DIM, KV_HEADS, 0, DIM**-0.5)
    with forward_context(AttentionMetadata(loc, lengths, causal=False)):
        batched = attention(q, k, v)
    for i, n in enumerate(lengths):
        rows = slice(loc[i], loc[i + 1])
        with forward_context(AttentionMetadata([0, n], [n], causal=False)):
            alone = attention(q[rows], k[rows], v[rows])
        torch.testing.assert_close(batched[rows], alone, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(12, 12, 32), (8, 2, 64), (6, 6, 48), (4, 4, 128), (4, 2, 40)],
    ids=["minilm", "gqa-64", "48", "128", "40-sdpa"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_varlen_kernel_bf16_head_sizes(heads, kv_heads, dim, causal) -> None:
    """bf16 through the kernel as the trunks call it (q, k, v strided views of one fused
    projection), against fp64 attention: lengths across the key-block (64) and query-chunk (256)
    boundaries, head sizes a multiple of 16 (oneDNN micro-kernels where bf16 is native) and not
    (SDPA); padding rows after the last request untouched."""
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    lengths = [1, 2, 63, 64, 65, 7, 300, 130, 31, 33]
    total = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    width = (heads + 2 * kv_heads) * dim
    fused = torch.randn(total + 5, width, generator=torch.Generator().manual_seed(7))
    fused = fused.bfloat16()
    q = fused[:, : heads * dim].view(-1, heads, dim)
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = fused[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    out = torch.full((total + 5, heads, dim), 7.0, dtype=torch.bfloat16)
    ops.varlen_attention(q, k, v, out, starts, lengths, dim**-0.5, causal)
    for start, n in zip(starts, lengths, strict=True):
        rows = slice(start, start + n)
        expected = _reference(q[rows], k[rows], v[rows], dim**-0.5, causal=causal)
        torch.testing.assert_close(out[rows].float(), expected.float(), atol=ATOL_BF16, rtol=2**-7)
    assert out[total:].eq(7.0).all()


def test_varlen_kernel_runs_micro_kernels_where_bf16_is_native() -> None:
    """The bf16 path runs on oneDNN's micro-kernels wherever the CPU multiplies bf16 natively:
    AMX, and AVX512-BF16 without AMX (AMD Zen 4/5). Gated on AMX alone it fell back to SDPA per
    request on an AMD EPYC Zen 5, whose MiniLM bf16 pass then ran 1.38x slower."""
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    assert ops.varlen_micro_kernels() == CpuPlatform().supports("bf16_fast")


def test_varlen_kernel_bf16_peaked_scores() -> None:
    """Scores hundreds apart in a row: most weights fall far below fp32's normal range (the
    kernel flushes those to zero); the result still matches fp64 attention, nothing is NaN, and
    the calling thread's floating-point mode (subnormals kept) is as before the call."""
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    lengths = [5, 70, 200]
    starts = [0, 5, 75]
    generator = torch.Generator().manual_seed(3)
    q = (torch.randn(275, 2, 32, generator=generator) * 12).bfloat16()
    k = (torch.randn(275, 2, 32, generator=generator) * 12).bfloat16()
    v = torch.randn(275, 2, 32, generator=generator).bfloat16()
    out = torch.empty_like(q)
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    ops.varlen_attention(q, k, v, out, starts, lengths, 32**-0.5, False)
    assert (tiny * 1.0).item() != 0.0  # subnormals still computed on the caller's thread
    assert not out.isnan().any()
    for start, n in zip(starts, lengths, strict=True):
        rows = slice(start, start + n)
        expected = _reference(q[rows], k[rows], v[rows], 32**-0.5, causal=False)
        torch.testing.assert_close(out[rows].float(), expected.float(), atol=ATOL_BF16, rtol=2**-7)


def test_varlen_kernel_rejects_bad_rows() -> None:
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    q = torch.zeros(10, HEADS, DIM)
    with pytest.raises(RuntimeError, match=r"request 1 rows \[8, 12\) outside the 10 rows"):
        ops.varlen_attention(q, q, q, torch.empty_like(q), [0, 8], [8, 4], 1.0, False)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.varlen_attention(q, q[:5], q[:5], torch.empty_like(q), [0], [5], 1.0, False)


def _alibi(slopes: list[float], n: int) -> torch.Tensor:
    """[heads, n, n] ALiBi bias written out: -slope * |i - j| (JinaBERT's symmetric form)."""
    bias = torch.zeros(len(slopes), n, n, dtype=torch.float64)
    for h, slope in enumerate(slopes):
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = -slope * abs(i - j)
    return bias


ALIBI_SLOPES = [0.5, 0.25, 0.0625, 2.0**-8]  # steep to flat


@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS], ids=["mha", "gqa"])
def test_encoder_alibi_matches_per_request_bias(kv_heads, encoder_path) -> None:
    """ALiBi slopes: the kernel (its SDPA path in fp32) and the Python loop against dense
    attention with the bias written out per request."""
    q, k, v, loc = _random_stream(LENGTHS, kv_heads=kv_heads, seed=4)
    attention = Attention(HEADS, DIM, kv_heads, 0, DIM**-0.5, alibi_slopes=ALIBI_SLOPES)
    with forward_context(AttentionMetadata(loc, LENGTHS, causal=False)):
        got = attention(q, k, v)
    bias = {n: _alibi(ALIBI_SLOPES, n) for n in set(LENGTHS)}
    expected = _per_request(q, k, v, loc, HEADS, kv_heads, bias_of=bias.__getitem__)
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)


def test_varlen_kernel_bf16_alibi() -> None:
    """bf16 ALiBi through the kernel (oneDNN micro-kernels where bf16 is native, the bias added
    to each row of scores) against fp64: lengths across the key-block (64) and query-chunk
    (256) boundaries."""
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    lengths, dim = [1, 63, 65, 300, 7], 32
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(sum(lengths), HEADS, dim, generator=generator).bfloat16() for _ in "qkv")
    out = torch.empty_like(q)
    slopes = torch.tensor(ALIBI_SLOPES)
    ops.varlen_attention(q, k, v, out, starts, lengths, dim**-0.5, False, slopes)
    for start, n in zip(starts, lengths, strict=True):
        rows = slice(start, start + n)
        bias = _alibi(ALIBI_SLOPES, n)
        expected = _reference(q[rows], k[rows], v[rows], dim**-0.5, bias=bias)
        torch.testing.assert_close(out[rows].float(), expected.float(), atol=ATOL_BF16, rtol=2**-7)


def test_alibi_refuses_what_it_does_not_compute() -> None:
    with pytest.raises(ValueError, match=r"one slope per head \(4, got 2\)"):
        Attention(HEADS, DIM, HEADS, 0, 1.0, alibi_slopes=[0.5, 0.25])
    with pytest.raises(ValueError, match="bidirectional attention without a sliding window"):
        Attention(HEADS, DIM, HEADS, 0, 1.0, causal=True, alibi_slopes=ALIBI_SLOPES)
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    q = torch.zeros(10, HEADS, DIM)
    slopes = torch.tensor(ALIBI_SLOPES)
    with pytest.raises(RuntimeError, match="bidirectional attention only"):
        ops.varlen_attention(q, q, q, torch.empty_like(q), [0], [10], 1.0, True, slopes)
    with pytest.raises(RuntimeError, match=r"one slope per query head \(4\)"):
        ops.varlen_attention(q, q, q, torch.empty_like(q), [0], [10], 1.0, False, slopes[:2])


# ---- paged decode ----------------------------------------------------------------------------


def _decode_step(seq_lens, dtype, kv_heads=KV_HEADS, seed=0):
    """KV caches filled at random and a step whose requests each decode one token, with
    shuffled, non-contiguous block tables."""
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(widths) + 3
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for width in widths:
        tables.append(ids[used : used + width])
        used += width
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK_SIZE, kv_heads, DIM), generator=generator)
    cache = cache.to(dtype)
    q = torch.randn(len(seq_lens), HEADS * DIM, generator=generator).to(dtype)
    k = torch.randn(len(seq_lens), kv_heads * DIM, generator=generator).to(dtype)
    v = torch.randn(len(seq_lens), kv_heads * DIM, generator=generator).to(dtype)
    slots = [
        t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
        for t, n in zip(tables, seq_lens, strict=True)
    ]
    metadata = AttentionMetadata(
        list(range(len(seq_lens) + 1)),
        list(seq_lens),
        causal=True,
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        block_size=BLOCK_SIZE,
        kv_caches=[cache],
    )
    return q, k, v, metadata


def _decode_reference(q, metadata, kv_heads, window=None, softcap=None):
    cache = metadata.kv_caches[0].float()
    rows = []
    for i, (table, n) in enumerate(zip(metadata.block_tables, metadata.seq_lens, strict=True)):
        keys = cache[0][:, table].reshape(kv_heads, -1, DIM)[:, :n].transpose(0, 1)
        values = cache[1][:, table].reshape(kv_heads, -1, DIM)[:, :n].transpose(0, 1)
        rows.append(
            _reference(
                q[i : i + 1].float().view(1, HEADS, DIM),
                keys,
                values,
                DIM**-0.5,
                causal=True,
                window=window,
                softcap=softcap,
            )
        )
    return torch.cat(rows).reshape(len(rows), -1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(sliding_window=6), dict(softcap=2.0), dict(kv_heads=HEADS)],
    ids=["gqa", "window", "softcap", "mha"],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
def test_decode_matches_reference(dtype, options, kernel) -> None:
    if kernel and attention_ops() is None:
        pytest.fail("the attention kernels did not build on this machine")
    kv_heads = options.pop("kv_heads", KV_HEADS)
    seq_lens = [1, 3, 4, 5, 17, 40, 9]
    q, k, v, metadata = _decode_step(seq_lens, dtype, kv_heads)
    attention = Attention(HEADS, DIM, kv_heads, 0, DIM**-0.5, **options)
    with forward_context(metadata), contextlib.nullcontext() if kernel else ops.use_torch():
        got = attention(q, k, v)
    assert got.dtype == dtype
    expected = _decode_reference(
        q, metadata, kv_heads, options.get("sliding_window"), options.get("softcap")
    )
    atol = ATOL_FP32 if dtype == torch.float32 else ATOL_BF16
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_decode_kernel_equals_gather_fp32() -> None:
    """Kernel and gather fallback agree within 1e-5 (fp32)."""
    q, k, v, metadata = _decode_step([7, 30, 2, 64], torch.float32, seed=4)
    attention = Attention(HEADS, DIM, KV_HEADS, 0, DIM**-0.5)
    with forward_context(metadata):
        with_kernel = attention(q, k, v)
    with forward_context(metadata), ops.use_torch():
        gathered = attention(q, k, v)
    torch.testing.assert_close(with_kernel, gathered, atol=ATOL_FP32, rtol=0)
    plan = paged_plan(metadata)
    assert plan.all_decode and plan.decode_ends.tolist() == [7, 30, 2, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size,softcap",
    [
        (9, 3, 64, 16, 0.0),  # SmolLM2's heads
        (9, 3, 64, 16, 20.0),
        (8, 1, 128, 5, 0.0),  # two groups of 4 query heads, runs of keys shorter than a vector
        (10, 2, 96, 7, 0.0),  # a group of 4 and of 1, an odd number of register pairs
        (6, 6, 32, 16, 0.0),
        (4, 2, 72, 16, 0.0),  # no vector path: the portable loops
    ],
)
def test_paged_kernel_head_sizes(dtype, heads, kv_heads, dim, block_size, softcap) -> None:
    """The kernel's paths for head sizes and query heads per kv head, on rows that start and end
    inside blocks, against fp32 torch."""
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    generator = torch.Generator().manual_seed(0)
    starts, ends = [0, 0, 3, 0, 9, 30], [1, 15, 16, 17, 40, 100]
    width = -(-max(ends) // block_size)
    num_blocks = len(ends) * width + 1
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, dim), generator=generator)
    cache = cache.to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(len(ends), width)
    q = torch.randn(len(ends), heads, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    got = ops.paged_attention(
        q, cache, tables, torch.tensor(starts), torch.tensor(ends), scale, softcap
    )
    assert got.dtype == dtype
    rows = cache.float().view(2, kv_heads, num_blocks * block_size, dim)
    for r, (start, end) in enumerate(zip(starts, ends, strict=True)):
        positions = torch.arange(start, end)
        slots = tables[r, positions // block_size] * block_size + positions % block_size
        keys, values = (t[:, slots].repeat_interleave(heads // kv_heads, 0) for t in rows)
        scores = q[r].float().unsqueeze(1) @ keys.transpose(1, 2) * scale  # [heads, 1, n]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        expected = (torch.softmax(scores, dim=-1) @ values).squeeze(1)
        atol = ATOL_FP32 if dtype == torch.float32 else ATOL_BF16
        torch.testing.assert_close(got[r].float(), expected, atol=atol, rtol=0)


def test_paged_kernel_rejects_bad_input() -> None:
    ops = attention_ops()
    if ops is None:
        pytest.fail("the attention kernels did not build on this machine")
    op = ops.paged_attention
    cache = torch.zeros(kv_cache_shape(2, BLOCK_SIZE, KV_HEADS, DIM))
    q = torch.zeros(1, HEADS, DIM)
    table, starts, ends = (
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1).long(),
        torch.ones(1).long(),
    )
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(q.double(), cache, table, starts, ends, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="block_tables must be int64"):
        op(q, cache, table.int(), starts, ends, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="head counts"):
        op(torch.zeros(1, 3, DIM), cache, table, starts, ends, 1.0, 0.0)


def test_kernel_build_failure_falls_back_with_a_log_line(tmp_path, monkeypatch, caplog) -> None:
    """A library that does not compile: one warning naming it, the callers get None / False and
    run plain torch (attention loops over requests)."""
    from cenote.kernels import build as kernels

    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "_SOURCES", [broken])
    monkeypatch.setenv("CENOTE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels._load_library.__wrapped__() is False
    assert "C++ kernels unavailable" in caplog.text
    assert "attention loops over requests" in caplog.text


@torch.inference_mode()
def test_encoder_kernel_under_inference_mode() -> None:
    """The runner calls the model under ``torch.inference_mode``: the kernel's worker threads
    must see it too (they write into an inference tensor)."""
    lengths = LENGTHS * 4
    q, k, v, loc = _random_stream(lengths, seed=5)
    attention = Attention(HEADS, DIM, KV_HEADS, 0, DIM**-0.5)
    with forward_context(AttentionMetadata(loc, lengths, causal=False)):
        got = attention(q, k, v)
    expected = _per_request(q, k, v, loc, HEADS, KV_HEADS)
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)
