// varlen_attention: requests of any lengths on a flat token stream, each attending only to its
// own rows, in one call (encoder batches, and decoder prompts run without a KV cache).
// With ALiBi slopes (JinaBERT), bidirectional only: score(i, j) -= slope[h] * |i - j| before the
// softmax, added row by row to the micro-kernels' scores, or as SDPA's bias per request.
//
// bf16, where oneDNN's brgemm micro-kernels run bf16 (AMX, or AVX512-BF16 without AMX as on AMD
// Zen 4/5; bf16_micro_kernels()):
// one task per (request, kv head), longest requests first, each thread taking the next task.
//   K^T and V are written once per task straight in the micro-kernels' VNNI layout, zero-padded
//   to a multiple of kKeyBlock keys; then for each query head of the group, kQueryRows query
//   rows at a time: S = Q K^T (fp32) -> softmax in fp32 -> weights rounded to bf16 ->
//   O = P V (fp32) -> O / sum rounded once to bf16, as torch's flash attention does per block.
//   Padded lengths keep the micro-kernels to a bounded set of shapes, each generated once.
//   Why not torch's SDPA per request: at encoder lengths (tens to hundreds of tokens, head size
//   32-64) it measured 110 GFLOP/s at 124 tokens, and attention took about 28% of a MiniLM
//   embedding pass for 5% of its FLOPs; this path is 1.29x faster on the benchmark corpus
//   (Intel AMX, 2 threads), and a MiniLM bf16 pass as a whole 1.38x faster on AMD EPYC Zen 5
//   (AVX512-BF16, no AMX: 175 -> 242 chunks/s). At head size 32 (MiniLM) a score costs the
//   micro-kernels 128 FLOPs and the softmax about one cycle, so the softmax's exp is written
//   for throughput: log2(e) folded into the scale, one rounding, five FMAs and a scalef per 16
//   weights, and subnormal weights flushed (FTZ/DAZ on the kernel's threads, restored after).
// Otherwise (fp32, CPUs without bf16 micro-kernels, head sizes not a multiple of 16): torch's
//   SDPA per request, one request per thread when there are enough of them, else one after the
//   other with SDPA's own threads. Each request's result is SDPA's on that request alone.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "include/attention_common.h"
#include "include/ops.h"
#include "include/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using cenote_attention::row_max;
using c10::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t kTile = 32;         // query rows round up to a multiple of it
constexpr int64_t kKeyBlock = 64;     // keys per packed block; key counts round up to it
constexpr int64_t kValueBlock = 64;   // value columns per packed block (oneDNN's limit)
constexpr int64_t kQueryRows = 256;   // query rows per micro-kernel call (bounds the scores)

constexpr unsigned int kFlushSubnormals = 0x8040;  // MXCSR: flush-to-zero, denormals-are-zero

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Layout {
  int64_t heads, kv_heads, dim, q_stride, kv_stride, out_stride;  // strides: between token rows
};

// Per-thread buffers of the bf16 path, grown to the longest request a thread meets.
struct Scratch {
  std::vector<BFloat16> kpack, vpack, qrows, probs;
  std::vector<float> scores, acc, inverse;

  void reserve(int64_t padded, int64_t dim) {
    kpack.resize(padded * dim);
    vpack.resize(padded * dim);
    const int64_t rows = std::min(kQueryRows, padded);  // padded >= length rounded to kTile
    qrows.resize(rows * dim);
    probs.resize(rows * padded);
    scores.resize(rows * padded);
    acc.resize(rows * dim);
    inverse.resize(rows);
  }
};

using cenote_bf16::float_to_bf16;

// 2^t for t <= 0, accurate to 3e-7 relative (weights are rounded to bf16, 2^-9, but their sum
// is not). 2^t = 2^n 2^f with n = round(t), |f| <= 1/2, and 2^f by a degree-5 polynomial
// (least squares in relative error on [-1/2, 1/2]); below 2^-126 the result is zero or
// subnormal (the caller flushes subnormals). The softmax folds log2(e) into its scale, so
// exp(x) = exp2_weight(x log2 e).
constexpr float kExp2Poly[6] = {1.0f,         0.69314700f, 0.24022225f,
                                0.05550712f, 0.00967018f, 0.00132609f};

inline __attribute__((always_inline)) float exp2_weight(float t) {
  const float n = std::nearbyint(std::max(t, -127.0f)), f = t - n;
  float y = kExp2Poly[5];
  for (int i = 4; i >= 0; --i) y = std::fma(y, f, kExp2Poly[i]);
  return std::ldexp(y, static_cast<int>(n));
}

#if defined(__AVX512F__)
// exp2_weight on 16 lanes: round, subtract, five FMAs and one scalef.
inline __m512 exp2_weight(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kExp2Poly[5]), f, _mm512_set1_ps(kExp2Poly[4]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[3]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[2]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[1]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2Poly[0]));
  return _mm512_scalef_ps(y, n);
}

// 16 fp32 lanes rounded to bf16 as float_to_bf16 rounds (finite values).
inline __m256i float_to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
#endif

// Softmax of the first `visible` of `padded` scores into bf16 weights (bits; zero past
// `visible`); returns 1 / (sum of the fp32 weights), applied to the output once. `scale2` is
// the attention scale times log2(e).
float softmax_row(const float* scores, int64_t visible, int64_t padded, float scale2,
                  uint16_t* probs) {
#if defined(__AVX512F__)
  const int64_t full = visible & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - full)) - 1);
  __m512 top0 = _mm512_set1_ps(scores[0]), top1 = top0;  // two chains of maxima
  int64_t j = 0;
  for (; j + 32 <= full; j += 32) {
    top0 = _mm512_max_ps(top0, _mm512_loadu_ps(scores + j));
    top1 = _mm512_max_ps(top1, _mm512_loadu_ps(scores + j + 16));
  }
  if (j < full) top0 = _mm512_max_ps(top0, _mm512_loadu_ps(scores + j));
  top0 = _mm512_mask_max_ps(top0, tail, top0, _mm512_maskz_loadu_ps(tail, scores + full));
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(top0, top1));
  const __m512 factor = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(top * scale2);
  __m512 total0 = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
  for (j = 0; j < full; j += 16) {
    const __m512 e = exp2_weight(_mm512_fmsub_ps(_mm512_loadu_ps(scores + j), factor, shift));
    if (j & 16) {
      total1 = _mm512_add_ps(total1, e);
    } else {
      total0 = _mm512_add_ps(total0, e);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), float_to_bf16(e));
  }
  if (tail) {
    const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, scores + j), factor, shift);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp2_weight(x));
    total0 = _mm512_add_ps(total0, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), float_to_bf16(e));
    j += 16;
  }
  std::fill(probs + j, probs + padded, uint16_t{0});  // j: visible rounded up to 16
  return 1.0f / _mm512_reduce_add_ps(_mm512_add_ps(total0, total1));
#else
  const float top = row_max(scores, visible);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < visible; ++j) {
    const float e = exp2_weight((scores[j] - top) * scale2);
    total += e;
    probs[j] = float_to_bf16(e);
  }
  std::fill(probs + visible, probs + padded, uint16_t{0});
  return 1.0f / total;
#endif
}

// The micro-kernels read B in VNNI layout: [K / 2][N][2], the two elements of a pair along the
// reduced dimension side by side. These write K^T and V in it straight from the token rows
// (stride `stride` elements), zero past the request's `length` rows, up to `padded` rows.

#if defined(__AVX512F__)
// r[i] (16 32-bit words each) -> its transpose in place: r[p] holds word p of r[0..15]. Three
// rounds of 16 shuffles: words in pairs of rows, then pairs of words in fours of rows (each
// 128-bit lane then holds one word of four rows), then the lanes of the fours gathered.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e], lane l: word 4l + e of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i low0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);   // lanes 0, 1 of each
    const __m512i high0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);  // lanes 2, 3
    const __m512i low1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i high1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(low0, low1, 0x88);       // lane 0 of all four: word e
    t[4 + e] = _mm512_shuffle_i32x4(low0, low1, 0xDD);   // lane 1: word 4 + e
    t[8 + e] = _mm512_shuffle_i32x4(high0, high1, 0x88);  // lane 2: word 8 + e
    t[12 + e] = _mm512_shuffle_i32x4(high0, high1, 0xDD);  // lane 3: word 12 + e
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// K^T in blocks of kKeyBlock keys, [D / 2][kKeyBlock] 32-bit words each: word (p, j) of block
// j0 is elements 2p, 2p + 1 of key j0 + j. With AVX-512, 16 keys x 16 pairs at a time by a
// register transpose (a gather per pair measured 28% of the kernel's own time on AMD Zen 4,
// where gathers are microcoded); pairs past a multiple of 16 (head size 48, 80, ...) by gathers.
void pack_keys(const BFloat16* k, int64_t length, int64_t padded, int64_t D, int64_t stride,
               uint32_t* out) {
  const auto* words = reinterpret_cast<const uint32_t*>(k);
  const int64_t word_stride = stride / 2, pairs = D / 2;
#if defined(__AVX512F__)
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(word_stride)));
  const int64_t square = pairs & ~int64_t{15};  // pairs covered by 16 x 16 transposes
  for (int64_t j = 0; j < padded; j += 16) {  // 16 keys
    const int64_t n = std::clamp<int64_t>(length - j, 0, 16);
    const __mmask16 in = static_cast<__mmask16>((1u << n) - 1);
    uint32_t* dst = out + (j / kKeyBlock) * kKeyBlock * pairs + j % kKeyBlock;
    for (int64_t p0 = 0; p0 < square; p0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = i < n ? _mm512_loadu_si512(words + (j + i) * word_stride + p0)
                     : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (p0 + p) * kKeyBlock, r[p]);
    }
    for (int64_t p = square; p < pairs; ++p) {  // one gather per pair of elements
      const uint32_t* first = words + j * word_stride + p;
      const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, rows, first, 4);
      _mm512_storeu_si512(dst + p * kKeyBlock, w);
    }
  }
#else
  for (int64_t j = 0; j < padded; ++j) {
    uint32_t* dst = out + (j / kKeyBlock) * kKeyBlock * pairs + j % kKeyBlock;
    for (int64_t p = 0; p < pairs; ++p) {
      dst[p * kKeyBlock] = j < length ? words[j * word_stride + p] : 0u;
    }
  }
#endif
}

// V in blocks of up to kValueBlock columns, [padded / 2][nb][2] each: element (j, c) of block
// n0 at [j / 2][c - n0][j % 2].
void pack_values(const BFloat16* v, int64_t length, int64_t padded, int64_t D, int64_t stride,
                 uint16_t* out) {
  const auto* rows = reinterpret_cast<const uint16_t*>(v);
  for (int64_t n0 = 0; n0 < D; n0 += kValueBlock) {
    const int64_t nb = std::min(kValueBlock, D - n0);
    uint16_t* block = out + n0 * padded;
    for (int64_t j = 0; j < padded; j += 2) {  // rows j and j + 1, interleaved
      uint16_t* dst = block + j * nb;
      const uint16_t* even = rows + j * stride + n0;
      const uint16_t* odd = even + stride;
      const bool has_even = j < length, has_odd = j + 1 < length;
#if defined(__AVX512BW__)
      const __m512i lo_index = _mm512_setr_epi32(
          0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005, 0x00260006,
          0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B, 0x002C000C, 0x002D000D,
          0x002E000E, 0x002F000F);
      const __m512i hi_index = _mm512_add_epi16(lo_index, _mm512_set1_epi16(16));
      for (int64_t c = 0; c < nb; c += 32) {  // 32 columns (or the last 16)
        const int64_t w = std::min<int64_t>(32, nb - c);
        const __mmask32 cols = w == 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << w) - 1);
        const __m512i zero = _mm512_setzero_si512();
        const __m512i a = has_even ? _mm512_maskz_loadu_epi16(cols, even + c) : zero;
        const __m512i b = has_odd ? _mm512_maskz_loadu_epi16(cols, odd + c) : zero;
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo_index, b));
        if (w > 16) {
          _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi_index, b));
        }
      }
#else
      for (int64_t c = 0; c < nb; ++c) {
        dst[2 * c] = has_even ? even[c] : 0;
        dst[2 * c + 1] = has_odd ? odd[c] : 0;
      }
#endif
    }
  }
}

// ALiBi on one row of raw scores (before the scale): score j -= step * |query - j|.
inline void add_alibi(float* scores, int64_t visible, int64_t query, float step) {
#pragma omp simd
  for (int64_t j = 0; j < visible; ++j) {
    scores[j] -= step * static_cast<float>(j > query ? j - query : query - j);
  }
}

// [1, heads, n, n] additive ALiBi bias of one request of n tokens: -slope[h] * |i - j|.
at::Tensor alibi_bias(const at::Tensor& slopes, int64_t n, at::ScalarType dtype) {
  const at::Tensor positions = at::arange(n, slopes.options());
  const at::Tensor distance = positions.unsqueeze(0).sub(positions.unsqueeze(1)).abs();
  return distance.unsqueeze(0).mul(slopes.neg().view({-1, 1, 1})).unsqueeze(0).to(dtype);
}

// Request rows [start, start + length), kv head `kvh` and its query heads, bf16 via brgemm.
// oneDNN packs (and its micro-kernels read) at most 64 columns of B at a time, so keys go in
// blocks of kKeyBlock and value columns in blocks of up to 64; queries go kQueryRows at a time.
// `alibi_step` (nullptr: none): per query head, the ALiBi slope over the attention scale,
// subtracted from the raw score once per position of distance between query and key.
void attend_brgemm(const BFloat16* q, const BFloat16* k, const BFloat16* v, BFloat16* out,
                   int64_t start, int64_t length, int64_t kvh, const Layout& l, float scale2,
                   bool causal, const float* alibi_step, Scratch& s) {
  const int64_t D = l.dim, P = round_up(length, kKeyBlock);
  const int64_t group = l.heads / l.kv_heads;
  s.reserve(P, D);
  pack_keys(k + start * l.kv_stride + kvh * D, length, P, D, l.kv_stride,
            reinterpret_cast<uint32_t*>(s.kpack.data()));
  pack_values(v + start * l.kv_stride + kvh * D, length, P, D, l.kv_stride,
              reinterpret_cast<uint16_t*>(s.vpack.data()));
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    for (int64_t i0 = 0; i0 < length; i0 += kQueryRows) {
      const int64_t m = std::min(kQueryRows, length - i0), M = round_up(m, kTile);
      std::fill(s.qrows.begin() + m * D, s.qrows.begin() + M * D, BFloat16(0.0f));
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(&s.qrows[r * D], q + (start + i0 + r) * l.q_stride + h * D,
                    D * sizeof(BFloat16));
      }
      // causal: keys past the chunk's last query are masked for all of its rows
      const int64_t keys = causal ? std::min(P, round_up(i0 + M, kKeyBlock)) : P;
      for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
        cpublas::brgemm(M, kKeyBlock, D, D, kKeyBlock, P, false, s.qrows.data(),
                        &s.kpack[j0 * D], &s.scores[j0]);
      }
      for (int64_t r = 0; r < M; ++r) {
        uint16_t* prow = reinterpret_cast<uint16_t*>(&s.probs[r * P]);
        if (r >= m) {  // padding rows of the last chunk
          std::fill(prow, prow + keys, uint16_t{0});
          continue;
        }
        const int64_t visible = causal ? i0 + r + 1 : length;
        if (alibi_step != nullptr) add_alibi(&s.scores[r * P], visible, i0 + r, alibi_step[h]);
        s.inverse[r] = softmax_row(&s.scores[r * P], visible, keys, scale2, prow);
      }
      for (int64_t n0 = 0; n0 < D; n0 += kValueBlock) {
        const int64_t nb = std::min(kValueBlock, D - n0);
        cpublas::brgemm(M, nb, keys, P, nb, D, false, s.probs.data(), &s.vpack[n0 * P],
                        &s.acc[n0]);
      }
      for (int64_t r = 0; r < m; ++r) {
        auto* orow = reinterpret_cast<uint16_t*>(out + (start + i0 + r) * l.out_stride + h * D);
        const float* arow = &s.acc[r * D];
        const float inv = s.inverse[r];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) orow[d] = float_to_bf16(arow[d] * inv);
      }
    }
  }
}

}  // namespace

// Whether the bf16 path runs here: the CPU multiplies bf16 natively (AMX, where
// cpublas::could_pack is true, or AVX512-BF16, asked of the CPU at run time so that a build for
// another arch (CENOTE_KERNEL_ARCH) takes the path too: the micro-kernels are torch's, not this
// file's; could_pack is false there, as they need no packing beyond the VNNI pairs this kernel
// writes) and torch's brgemm gives the right product on a small check, once. Elsewhere (AVX2
// only, or a torch without the micro-kernels) brgemm would fail or crawl.
bool bf16_micro_kernels() {
  static const bool ok = [] {
    bool native = cpublas::could_pack(at::kBFloat16);
#if defined(__x86_64__)
    __builtin_cpu_init();
    native = native || __builtin_cpu_supports("avx512bf16");
#endif
    if (!native) return false;
    constexpr int64_t M = 2, N = 64, K = 32;
    std::vector<BFloat16> a(M * K), b(K * N);  // b in VNNI pairs: [K / 2][N][2]
    std::vector<float> c(M * N, -1.0f);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t kk = 0; kk < K; ++kk) a[i * K + kk] = BFloat16(float(kk % 3 - 1 + i));
    }
    for (int64_t kk = 0; kk < K; ++kk) {
      for (int64_t n = 0; n < N; ++n) {
        b[(kk / 2) * N * 2 + n * 2 + kk % 2] = BFloat16(float((kk + 2 * n) % 5 - 2));
      }
    }
    try {
      cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data());
      cpublas::brgemm_release();
    } catch (const c10::Error&) {
      return false;
    }
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t n = 0; n < N; ++n) {
        float expected = 0.0f;  // small integers: exact in bf16 and fp32
        for (int64_t kk = 0; kk < K; ++kk) {
          expected += float(kk % 3 - 1 + i) * float((kk + 2 * n) % 5 - 2);
        }
        if (c[i * N + n] != expected) return false;
      }
    }
    return true;
  }();
  return ok;
}

void varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& out, c10::IntArrayRef starts, c10::IntArrayRef lengths,
                      double scale, bool causal, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "q, k, v and out must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && out.sizes() == q.sizes() && k.size(0) == q.size(0),
              "q, k, v and out shapes do not match");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(starts.size() == lengths.size(), "starts and lengths differ in size");
  const int64_t num_requests = static_cast<int64_t>(starts.size());
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK(lengths[r] > 0 && starts[r] >= 0 && starts[r] + lengths[r] <= q.size(0),
                "request ", r, " rows [", starts[r], ", ", starts[r] + lengths[r],
                ") outside the ", q.size(0), " rows");
  }
  std::vector<float> alibi_step;  // per query head: slope / scale (empty: no ALiBi)
  at::Tensor slopes;              // fp32 [heads], for the SDPA path's bias
  if (alibi_slopes.has_value()) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(slopes.dim() == 1 && slopes.size(0) == q.size(1),
                "alibi_slopes must hold one slope per query head (", q.size(1), "), got ",
                slopes.sizes());
    TORCH_CHECK(!causal, "ALiBi is implemented for bidirectional attention only");
    for (int64_t h = 0; h < q.size(1); ++h) {
      alibi_step.push_back(static_cast<float>(slopes.const_data_ptr<float>()[h] / scale));
    }
  }
  const float* step = alibi_step.empty() ? nullptr : alibi_step.data();
  std::vector<int64_t> by_length(num_requests);
  std::iota(by_length.begin(), by_length.end(), 0);
  std::stable_sort(by_length.begin(), by_length.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  const int64_t kv_heads = k.size(1), dim = q.size(2);
  const bool micro_kernels = q.scalar_type() == at::kBFloat16 && dim % 16 == 0 &&
                             q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                             out.stride(2) == 1 && k.stride(0) == v.stride(0) &&
                             k.stride(0) % 2 == 0 &&
                             q.stride(1) == dim && k.stride(1) == dim && v.stride(1) == dim &&
                             out.stride(1) == dim &&
                             bf16_micro_kernels();
  if (micro_kernels) {
    const Layout l{q.size(1), kv_heads, dim, q.stride(0), k.stride(0), out.stride(0)};
    std::vector<int64_t> tasks;  // request * kv_heads + kv head, longest requests first
    tasks.reserve(num_requests * kv_heads);
    for (int64_t r : by_length) {
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back(r * kv_heads + h);
    }
    const auto* qd = q.const_data_ptr<BFloat16>();
    const auto* kd = k.const_data_ptr<BFloat16>();
    const auto* vd = v.const_data_ptr<BFloat16>();
    auto* od = out.mutable_data_ptr<BFloat16>();
    const float scale2 = static_cast<float>(scale * 1.4426950408889634);  // scale * log2(e)
    cenote::share_tasks(static_cast<int64_t>(tasks.size()), [&](auto& next) {
      // subnormal weights (exp of scores far below the row's maximum) flushed to zero: they
      // cannot move a sum of at least 1, and computing them costs microcode assists
#if defined(__x86_64__)
      const unsigned int csr = _mm_getcsr();
      _mm_setcsr(csr | kFlushSubnormals);
#endif
      Scratch scratch;
      for (int64_t i = next(); i >= 0; i = next()) {
        const int64_t r = tasks[i] / kv_heads, h = tasks[i] % kv_heads;
        attend_brgemm(qd, kd, vd, od, starts[r], lengths[r], h, l, scale2, causal, step,
                      scratch);
      }
      cpublas::brgemm_release();
#if defined(__x86_64__)
      _mm_setcsr(csr);
#endif
    });
    return;
  }
  const bool gqa = q.size(1) != k.size(1);
  auto attend = [&](int64_t r) {
    const int64_t start = starts[r], end = starts[r] + lengths[r];
    auto rows = [&](const at::Tensor& t) {  // [1, heads, length, dim] view of the request
      return t.slice(0, start, end).unsqueeze(0).transpose(1, 2);
    };
    std::optional<at::Tensor> bias;
    if (step != nullptr) bias = alibi_bias(slopes, end - start, q.scalar_type());
    at::Tensor result = at::scaled_dot_product_attention(rows(q), rows(k), rows(v), bias, 0.0,
                                                         causal, scale, gqa);
    out.slice(0, start, end).copy_(result[0].transpose(0, 1));
  };
  // one request per thread pays when no request alone outweighs a thread's share
  const int64_t threads = at::get_num_threads();
  double total = 0.0;
  for (int64_t r = 0; r < num_requests; ++r) total += double(lengths[r]) * double(lengths[r]);
  const double longest =
      num_requests ? double(lengths[by_length[0]]) * double(lengths[by_length[0]]) : 0;
  if (threads > 1 && num_requests >= 2 * threads && longest * threads <= total) {
    cenote::share_tasks(num_requests, [&](auto& next) {
      for (int64_t i = next(); i >= 0; i = next()) attend(by_length[i]);
    });
  } else {
    for (int64_t r = 0; r < num_requests; ++r) attend(r);
  }
}
