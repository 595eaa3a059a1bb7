// Every LoRA update of one linear layer in one call (cenote/models/layers/lora.py):
//
//   lora_shrink_expand(out [M, N], x [M, K], a[S], b[S], row_starts[S], row_ends[S],
//                      col_starts[S], scales[S]):
//       for every segment s: out[r0:r1, c0:c0+n] += scales[s] * (x[r0:r1] @ a[s]^T) @ b[s]^T
//       with a[s] [rank_s, K], b[s] [n, rank_s], r0:r1 = row_starts[s]:row_ends[s],
//       c0 = col_starts[s]; in place. Segments may not overlap (an output element belongs to
//       one segment at most: one adapter's rows, one of its blocks); overlapping ones raise.
//
// A segment is one adapter's rows times one block of output columns (a fused q/k/v projection
// has a block per target), so a step with four adapters on a fused projection is one call
// instead of 4 x 3 x 5 torch ops. x and out are fp32 or bf16 (the same dtype); each segment's
// factors are fp32 or bf16. Sums are fp32 and each output element is rounded once, when it is
// added to out. With fp32 factors, or off AVX512-BF16, the shrink ``t = x @ a^T`` stays fp32
// (torch's bf16 path rounds t, the product and the sum). bf16 factors on bf16 rows take
// vdpbf16ps for both products (exact bf16 products, fp32 sums; docs/performance.md): t is
// rounded once to bf16 between them, as torch rounds it.
//
// Two phases, each shared among torch's threads: (1) shrink, one task per segment and block of
// kRowBlock rows; (2) expand, one task per segment, chunk of kRowChunk rows and tile of kColTile
// output columns, whose factor columns are transposed once so the tile's columns are summed
// side by side, several rows at a time. Each row's sums run in the same order whatever the
// other rows of its block or segment are (row results do not depend on the batch). AVX-512
// (+ BF16), AVX2 + FMA or scalar code is compiled for the build's arch (CENOTE_KERNEL_ARCH).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "include/bf16_bits.h"
#include "include/ops.h"
#include "include/parallel.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowBlock = 4;   // rows of one shrink task, sharing each factor load
constexpr int64_t kColTile = 64;   // output columns of one expand task
constexpr int64_t kRowChunk = 32;    // rows of one expand task (long runs split among threads)
constexpr int64_t kColGroup = 512;  // columns of one expand task (whole tiles)
// below this many multiply-adds a call runs on the calling thread: waking the pool costs more
// than the work (a decode step's update is ~0.3 M)
constexpr int64_t kInlineWork = 1 << 18;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return cenote_bf16::bf16_to_float(v); }
inline void store(float& out, float v) { out = v; }
inline void store(uint16_t& out, float v) { out = cenote_bf16::float_to_bf16(v); }

// One vector of kLanes fp32 values, for the build's instruction set; vstore to bf16 rounds to
// nearest even, any NaN to 0x7FC0 (cenote_bf16::float_to_bf16, lane by lane).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512BF16__)
// one instruction; it flushes denormal sums to zero and keeps a NaN's sign and top bits (the
// integer rounding below turns them into the nearest bf16 and 0x7FC0)
inline void vstore(uint16_t* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
inline void vstore(uint16_t* p, Vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_srli_epi32(up, 16),
                                             _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                             _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(uint16_t* p, Vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i bits =
      _mm256_blendv_epi8(_mm256_srli_epi32(up, 16), _mm256_set1_epi32(0x7FC0), nan);
  // 32 -> 16 bits within each 128-bit half, then the halves' low quads together
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vset1(float v) { return v; }
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const uint16_t* p) { return cenote_bf16::bf16_to_float(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }  // -ffp-contract=off: two roundings
inline void vstore(float* p, Vec v) { *p = v; }
inline void vstore(uint16_t* p, Vec v) { *p = cenote_bf16::float_to_bf16(v); }
#endif

constexpr int64_t kTileVectors = kColTile / kLanes;
// expand: rows of one register block, so that its accumulators fill 16 registers and each
// factor load meets every row of it (AVX-512 4, AVX2 2, scalar 1)
constexpr int64_t kExpandRows = kTileVectors >= 16 ? 1 : 16 / kTileVectors;
// shrink: ranks of one register block beside up to kRowBlock rows
constexpr int64_t kShrinkRanks = kLanes == 16 ? 4 : 2;

// The lanes of v added in a fixed order (AVX-512: halves folded, a tree of 4 adds).
#if defined(__AVX512F__)
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
inline float vsum(Vec v) {
  float lanes[kLanes];
  vstore(lanes, v);
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += lanes[i];
  return sum;
}
#endif

// One segment as the kernel reads it.
struct Segment {
  const void* a;  // [rank, K]
  const void* b;  // [n, rank]
  int64_t rows_start, rows_end, col_start, n, rank;
  float scale;
  bool bf16;  // a and b are bf16 (else fp32)
  bool pairs;  // bf16 factors on bf16 rows with AVX512-BF16: the expand on t rounded to pairs
  int64_t t_offset;     // where its shrunk rows start in the fp32 buffer ([rows, rank])
  int64_t pair_offset;  // ... and their pairs in the pair buffer ([rows, (rank + 1) / 2])
  int64_t tile_offset;  // where its factor tiles start in the fp32 or the pair tile buffer
};

// A rank's pair count, and the size of a segment's transposed factor tile (fp32 values or
// pair words): ranks (or pairs) times kColTile columns.
inline int64_t num_pairs(int64_t rank) { return (rank + 1) / 2; }
inline int64_t tile_size(const Segment& s) {
  return (s.pairs ? num_pairs(s.rank) : s.rank) * kColTile;
}

// bf16 bits of ranks k and k + 1 of ``value`` in one 32-bit word (k + 1 == rank: zero).
template <typename F>
inline uint32_t pair_word(F&& value, int64_t k, int64_t rank) {
  return static_cast<uint32_t>(value(k)) |
         (k + 1 < rank ? static_cast<uint32_t>(value(k + 1)) << 16 : 0u);
}

// t[i, k0 + q] = x[i] . a[k0 + q] for R rows of fp32 x and KR ranks: each sum is kLanes partial
// sums over K (vector part), added in lane order, then the tail in column order; the same
// operations for a row whatever R and KR are (a row's result does not depend on its block).
template <int64_t R, int64_t KR, typename W>
void shrink_tile(const float* x, int64_t k_dim, const W* a, int64_t rank, int64_t k0, float* t) {
  const int64_t vec_end = k_dim / kLanes * kLanes;
  Vec acc[R][KR];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t q = 0; q < KR; ++q) acc[i][q] = vzero();
  for (int64_t j = 0; j < vec_end; j += kLanes) {
    Vec w[KR];
    for (int64_t q = 0; q < KR; ++q) w[q] = vload(a + (k0 + q) * k_dim + j);
    for (int64_t i = 0; i < R; ++i) {
      const Vec xv = vload(x + i * k_dim + j);
      for (int64_t q = 0; q < KR; ++q) acc[i][q] = vfma(xv, w[q], acc[i][q]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t q = 0; q < KR; ++q) {
      const W* a_row = a + (k0 + q) * k_dim;
      float sum = vsum(acc[i][q]);
      for (int64_t j = vec_end; j < k_dim; ++j) sum += x[i * k_dim + j] * to_float(a_row[j]);
      t[i * rank + k0 + q] = sum;
    }
}

template <int64_t R, typename W>
void shrink_rows(const float* x, int64_t k_dim, const W* a, int64_t rank, float* t) {
  int64_t k0 = 0;
  for (; k0 + kShrinkRanks <= rank; k0 += kShrinkRanks)
    shrink_tile<R, kShrinkRanks>(x, k_dim, a, rank, k0, t);
  for (; k0 < rank; ++k0) shrink_tile<R, 1>(x, k_dim, a, rank, k0, t);
}

// t = x[rows] @ a^T for ``rows`` (<= kRowBlock) rows of fp32 x.
template <typename W>
void shrink_block(const float* x, int64_t k_dim, int64_t rows, const W* a, int64_t rank, float* t) {
  switch (rows) {
    case 4: return shrink_rows<4>(x, k_dim, a, rank, t);
    case 3: return shrink_rows<3>(x, k_dim, a, rank, t);
    case 2: return shrink_rows<2>(x, k_dim, a, rank, t);
    default: return shrink_rows<1>(x, k_dim, a, rank, t);
  }
}

#if defined(__AVX512BF16__)
// bf16 rows times bf16 factors: vdpbf16ps multiplies 32 pairs a step, each product exact in
// fp32, the partial sums in 16 fp32 lanes (added in lane order), K's tail read through a mask
// as zeros. Twice the products of an fp32 FMA per instruction, and x is read as it is stored.
template <int64_t R, int64_t KR>
void shrink_tile_bf16(const uint16_t* x, int64_t k_dim, const uint16_t* a, int64_t rank,
                      int64_t k0, float* t) {
  __m512 acc[R][KR];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t q = 0; q < KR; ++q) acc[i][q] = _mm512_setzero_ps();
  const int64_t full = k_dim / 32 * 32;
  for (int64_t j = 0; j < full; j += 32) {
    __m512bh w[KR];
    for (int64_t q = 0; q < KR; ++q)
      w[q] = (__m512bh)_mm512_loadu_si512(a + (k0 + q) * k_dim + j);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k_dim + j);
      for (int64_t q = 0; q < KR; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], xv, w[q]);
    }
  }
  if (full < k_dim) {  // K's tail, read as zeros past its end
    const auto mask = static_cast<__mmask32>((uint64_t{1} << (k_dim - full)) - 1);
    __m512bh w[KR];
    for (int64_t q = 0; q < KR; ++q)
      w[q] = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + (k0 + q) * k_dim + full);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k_dim + full);
      for (int64_t q = 0; q < KR; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], xv, w[q]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t q = 0; q < KR; ++q) t[i * rank + k0 + q] = vsum(acc[i][q]);
}

template <int64_t R>
void shrink_rows_bf16(const uint16_t* x, int64_t k_dim, const uint16_t* a, int64_t rank,
                      float* t) {
  int64_t k0 = 0;
  for (; k0 + kShrinkRanks <= rank; k0 += kShrinkRanks)
    shrink_tile_bf16<R, kShrinkRanks>(x, k_dim, a, rank, k0, t);
  for (; k0 < rank; ++k0) shrink_tile_bf16<R, 1>(x, k_dim, a, rank, k0, t);
}

void shrink_block_bf16(const uint16_t* x, int64_t k_dim, int64_t rows, const uint16_t* a,
                       int64_t rank, float* t) {
  switch (rows) {
    case 4: return shrink_rows_bf16<4>(x, k_dim, a, rank, t);
    case 3: return shrink_rows_bf16<3>(x, k_dim, a, rank, t);
    case 2: return shrink_rows_bf16<2>(x, k_dim, a, rank, t);
    default: return shrink_rows_bf16<1>(x, k_dim, a, rank, t);
  }
}

// The expand of bf16 factors on bf16 rows: t rounded once to bf16 (``t_pairs``: row i's ranks
// 2p and 2p + 1 in one 32-bit word, the odd rank's partner zero), then vdpbf16ps over pairs of
// ranks, each lane a column, exact products summed in fp32: twice the products of an fp32 FMA
// per instruction. ``bt`` holds the tile's factor pairs ([pairs, kColTile] words, zero past
// ``width``). Each column's sum runs over the pairs in order, whatever R is.
template <int64_t R>
void expand_rows_bf16(const uint32_t* t_pairs, int64_t pairs, const uint32_t* bt, int64_t width,
                      float scale, uint16_t* out, int64_t n_dim) {
  constexpr int64_t kVectors = kColTile / 16;
  __m512 acc[R][kVectors];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t v = 0; v < kVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh tp[R];
    for (int64_t i = 0; i < R; ++i) tp[i] = (__m512bh)_mm512_set1_epi32(t_pairs[i * pairs + p]);
    for (int64_t v = 0; v < kVectors; ++v) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(bt + p * kColTile + v * 16);
      for (int64_t i = 0; i < R; ++i) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], tp[i], w);
    }
  }
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < R; ++i) {
    uint16_t* out_row = out + i * n_dim;
    int64_t c = 0;
    for (int64_t v = 0; c + 16 <= width; ++v, c += 16)
      vstore(out_row + c, vload(out_row + c) + acc[i][v] * scales);
    if (c < width) {
      float sums[16];
      vstore(sums, acc[i][c / 16] * scales);
      for (; c < width; ++c) store(out_row[c], to_float(out_row[c]) + sums[c % 16]);
    }
  }
}

// The tile of factor columns [c_begin, c_begin + kColTile) as pair words, [pairs, kColTile],
// zero past the segment's columns.
void pair_tile(const Segment& s, int64_t c_begin, uint32_t* bt) {
  const auto* b = static_cast<const uint16_t*>(s.b);
  const int64_t width = std::min(kColTile, s.n - c_begin), pairs = num_pairs(s.rank);
  std::fill(bt, bt + pairs * kColTile, 0u);
  for (int64_t c = 0; c < width; ++c) {
    const uint16_t* column = b + (c_begin + c) * s.rank;
    for (int64_t p = 0; p < pairs; ++p)
      bt[p * kColTile + c] = pair_word([&](int64_t k) { return column[k]; }, 2 * p, s.rank);
  }
}

// Rows of t (fp32, [rows, rank]) rounded to bf16 pair words ([rows, pairs]).
void pair_rows(const float* t, int64_t rows, int64_t rank, uint32_t* t_pairs) {
  const int64_t pairs = num_pairs(rank);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < pairs; ++p)
      t_pairs[r * pairs + p] = pair_word(
          [&](int64_t k) { return cenote_bf16::float_to_bf16(t[r * rank + k]); }, 2 * p, rank);
}

// The expand of bf16 factors on bf16 rows for the columns [c_begin, c_end) (whole tiles from
// c_begin) and rows [r_begin, r_end) of a segment, from its t pairs and the factor pairs of the
// first of those tiles, ``bt``: row blocks outer, tiles inner, so out is read and written
// row by row.
void expand_tile_bf16(const Segment& s, const uint32_t* t_pairs, const uint32_t* bt,
                      int64_t c_begin, int64_t c_end, int64_t r_begin, int64_t r_end,
                      uint16_t* out, int64_t n_dim) {
  const int64_t pairs = num_pairs(s.rank);
  for (int64_t r = r_begin; r < r_end;) {
    const bool block = r + 4 <= r_end;
    for (int64_t c = c_begin; c < c_end; c += kColTile) {
      const uint32_t* tile_bt = bt + (c - c_begin) / kColTile * pairs * kColTile;
      const int64_t width = std::min(kColTile, c_end - c);
      uint16_t* tile = out + r * n_dim + s.col_start + c;
      const uint32_t* rows = t_pairs + (r - s.rows_start) * pairs;
      if (block)
        expand_rows_bf16<4>(rows, pairs, tile_bt, width, s.scale, tile, n_dim);
      else
        expand_rows_bf16<1>(rows, pairs, tile_bt, width, s.scale, tile, n_dim);
    }
    r += block ? 4 : 1;
  }
}
#endif

// out[r, c] += scale * sum_k t[r, k] * bt[k, c] for R rows from ``t`` / ``out`` and the ``width``
// (<= kColTile) columns of a tile; ``bt`` is the tile's factor columns, transposed to fp32 and
// zero past ``width``. Each column's sum runs over k in order, one FMA a term, whatever R is.
template <int64_t R, typename X>
void expand_rows(const float* t, int64_t rank, const float* bt, int64_t width, float scale,
                 X* out, int64_t n_dim) {
  Vec acc[R][kTileVectors];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t v = 0; v < kTileVectors; ++v) acc[i][v] = vzero();
  for (int64_t k = 0; k < rank; ++k) {
    Vec tk[R];
    for (int64_t i = 0; i < R; ++i) tk[i] = vset1(t[i * rank + k]);
    for (int64_t v = 0; v < kTileVectors; ++v) {
      const Vec w = vload(bt + k * kColTile + v * kLanes);
      for (int64_t i = 0; i < R; ++i) acc[i][v] = vfma(tk[i], w, acc[i][v]);
    }
  }
  const Vec scales = vset1(scale);
  for (int64_t i = 0; i < R; ++i) {
    X* out_row = out + i * n_dim;
    int64_t c = 0;
    for (int64_t v = 0; c + kLanes <= width; ++v, c += kLanes)
      vstore(out_row + c, vload(out_row + c) + acc[i][v] * scales);
    if (c < width) {  // the last partial vector, a column at a time
      float sums[kLanes];
      vstore(sums, acc[i][c / kLanes] * scales);
      for (; c < width; ++c) store(out_row[c], to_float(out_row[c]) + sums[c % kLanes]);
    }
  }
}

// The tile of factor columns [c_begin, c_begin + kColTile) transposed to fp32, [rank,
// kColTile], zero past the segment's columns.
template <typename W>
void transpose_tile(const Segment& s, int64_t c_begin, float* bt) {
  const W* b = static_cast<const W*>(s.b);
  const int64_t width = std::min(kColTile, s.n - c_begin);
  std::fill(bt, bt + s.rank * kColTile, 0.f);
  for (int64_t c = 0; c < width; ++c)
    for (int64_t k = 0; k < s.rank; ++k)
      bt[k * kColTile + c] = to_float(b[(c_begin + c) * s.rank + k]);
}

// out[r, c0 + c] += scale * sum_k t[r, k] * b[c, k] for the columns [c_begin, c_end) (whole
// tiles from c_begin) and rows [r_begin, r_end) of one segment, ``bt`` the first of those
// tiles transposed: row blocks outer, tiles inner.
template <typename X>
void expand_tile(const Segment& s, const float* t, const float* bt, int64_t c_begin,
                 int64_t c_end, int64_t r_begin, int64_t r_end, X* out, int64_t n_dim) {
  for (int64_t r = r_begin; r < r_end;) {
    const bool block = r + kExpandRows <= r_end;
    for (int64_t c = c_begin; c < c_end; c += kColTile) {
      const float* tile_bt = bt + (c - c_begin) / kColTile * s.rank * kColTile;
      const int64_t width = std::min(kColTile, c_end - c);
      X* tile = out + r * n_dim + s.col_start + c;
      const float* rows = t + (r - s.rows_start) * s.rank;
      if (block)
        expand_rows<kExpandRows>(rows, s.rank, tile_bt, width, s.scale, tile, n_dim);
      else
        expand_rows<1>(rows, s.rank, tile_bt, width, s.scale, tile, n_dim);
    }
    r += block ? kExpandRows : 1;
  }
}

// Runs worker(next) on the calling thread alone for small work, else on every torch thread.
template <typename F>
void run_tasks(int64_t tasks, int64_t work, F&& worker) {
  if (work < kInlineWork) {
    int64_t i = 0;
    worker([&]() -> int64_t { return i < tasks ? i++ : -1; });
    return;
  }
  cenote::share_tasks(tasks, worker);
}

// t = x[r:r + rows] @ a^T for one shrink task: bf16 pairs where both are bf16 and the CPU has
// AVX512-BF16, else fp32 FMAs over x widened once into ``wide`` (exactly).
template <typename X, typename W>
void shrink_task(const X* x, int64_t k_dim, int64_t rows, const W* a, int64_t rank, float* t,
                 std::vector<float>& wide) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t>) {
    shrink_block_bf16(x, k_dim, rows, a, rank, t);
    return;
  }
#endif
  if constexpr (std::is_same_v<X, float>) {
    shrink_block(x, k_dim, rows, a, rank, t);
  } else {
    wide.resize(rows * k_dim);
    for (int64_t j = 0; j < rows * k_dim; ++j) wide[j] = to_float(x[j]);
    shrink_block(wide.data(), k_dim, rows, a, rank, t);
  }
}

// One shrink task of a segment whose factors are W.
template <typename X, typename W>
void shrink_segment_rows(const Segment& seg, const X* x, int64_t k_dim, int64_t row,
                         float* t, std::vector<float>& wide) {
  const int64_t rows = std::min(kRowBlock, seg.rows_end - row);
  shrink_task(x + row * k_dim, k_dim, rows, static_cast<const W*>(seg.a), seg.rank,
              t + seg.t_offset + (row - seg.rows_start) * seg.rank, wide);
}

template <typename X>
void run(at::Tensor& out, const at::Tensor& x, std::vector<Segment>& segments) {
  const int64_t k_dim = x.size(1), n_dim = out.size(1);
  const X* xs = reinterpret_cast<const X*>(x.data_ptr());
  X* outs = reinterpret_cast<X*>(out.data_ptr());
  struct Task {
    int64_t segment, row, column;  // phase 1: row < 0 marks a factor tile's transposition
  };
  // phase 1: (segment, first row) shrinks and (segment, -1, first column) factor tiles;
  // phase 2: (segment, first row, first column) expands
  std::vector<Task> prepare_tasks, expand_tasks;
  int64_t t_size = 0, pair_size = 0, tile_sizes[2] = {0, 0}, work = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s) {
    Segment& seg = segments[s];
    const int64_t rows = seg.rows_end - seg.rows_start;
    if (rows == 0) continue;
#if defined(__AVX512BF16__)
    seg.pairs = std::is_same_v<X, uint16_t> && seg.bf16;
#endif
    seg.t_offset = t_size;
    t_size += rows * seg.rank;
    seg.pair_offset = pair_size;
    if (seg.pairs) pair_size += rows * num_pairs(seg.rank);
    seg.tile_offset = tile_sizes[seg.pairs];
    tile_sizes[seg.pairs] += (seg.n + kColTile - 1) / kColTile * tile_size(seg);
    work += rows * seg.rank * (k_dim + seg.n);
    for (int64_t r = seg.rows_start; r < seg.rows_end; r += kRowBlock)
      prepare_tasks.push_back({s, r, 0});
    for (int64_t c = 0; c < seg.n; c += kColTile) prepare_tasks.push_back({s, -1, c});
    for (int64_t r = seg.rows_start; r < seg.rows_end; r += kRowChunk)
      for (int64_t c = 0; c < seg.n; c += kColGroup) expand_tasks.push_back({s, r, c});
  }
  std::vector<float> t(t_size), tiles(tile_sizes[0]);
  std::vector<uint32_t> t_pairs(pair_size), pair_tiles(tile_sizes[1]);
  // 1) shrink: t = x[rows] @ a^T per segment (and t's pairs); the factor tiles for 2)
  run_tasks(static_cast<int64_t>(prepare_tasks.size()), work, [&](auto next) {
    std::vector<float> wide;  // this thread's rows widened to fp32
    for (int64_t i = next(); i >= 0; i = next()) {
      const Task task = prepare_tasks[i];
      const Segment& seg = segments[task.segment];
      if (task.row < 0) {
        const int64_t tile = seg.tile_offset + task.column / kColTile * tile_size(seg);
#if defined(__AVX512BF16__)
        if (seg.pairs) {
          pair_tile(seg, task.column, pair_tiles.data() + tile);
          continue;
        }
#endif
        if (seg.bf16)
          transpose_tile<uint16_t>(seg, task.column, tiles.data() + tile);
        else
          transpose_tile<float>(seg, task.column, tiles.data() + tile);
        continue;
      }
      if (seg.bf16)
        shrink_segment_rows<X, uint16_t>(seg, xs, k_dim, task.row, t.data(), wide);
      else
        shrink_segment_rows<X, float>(seg, xs, k_dim, task.row, t.data(), wide);
#if defined(__AVX512BF16__)
      if (seg.pairs) {
        const int64_t r = task.row - seg.rows_start;
        pair_rows(t.data() + seg.t_offset + r * seg.rank,
                  std::min(kRowBlock, seg.rows_end - task.row), seg.rank,
                  t_pairs.data() + seg.pair_offset + r * num_pairs(seg.rank));
      }
#endif
    }
  });
  // 2) expand: out[rows, block] += scale * t @ b^T per segment, chunk of rows and column tile
  run_tasks(static_cast<int64_t>(expand_tasks.size()), work, [&](auto next) {
    for (int64_t i = next(); i >= 0; i = next()) {
      const Task task = expand_tasks[i];
      const Segment& seg = segments[task.segment];
      const int64_t c_end = std::min(task.column + kColGroup, seg.n);
      const int64_t r_end = std::min(task.row + kRowChunk, seg.rows_end);
      const int64_t tile = seg.tile_offset + task.column / kColTile * tile_size(seg);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<X, uint16_t>) {
        if (seg.pairs) {
          expand_tile_bf16(seg, t_pairs.data() + seg.pair_offset, pair_tiles.data() + tile,
                           task.column, c_end, task.row, r_end, outs, n_dim);
          continue;
        }
      }
#endif
      expand_tile(seg, t.data() + seg.t_offset, tiles.data() + tile, task.column, c_end,
                  task.row, r_end, outs, n_dim);
    }
  });
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void lora_shrink_expand(at::Tensor out, const at::Tensor& x, at::TensorList a, at::TensorList b,
                        c10::IntArrayRef row_starts, c10::IntArrayRef row_ends,
                        c10::IntArrayRef col_starts, c10::ArrayRef<double> scales) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "lora_shrink_expand: x must be [M, K] and out [M, N] with the same M; got x ",
              x.sizes(), " and out ", out.sizes());
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(),
              "lora_shrink_expand: x and out must be contiguous");
  TORCH_CHECK(is_float_or_bf16(x) && x.scalar_type() == out.scalar_type(),
              "lora_shrink_expand: x and out must be both float32 or both bfloat16; got ",
              x.scalar_type(), " and ", out.scalar_type());
  const int64_t count = static_cast<int64_t>(a.size());
  TORCH_CHECK(static_cast<int64_t>(b.size()) == count &&
                  static_cast<int64_t>(row_starts.size()) == count &&
                  static_cast<int64_t>(row_ends.size()) == count &&
                  static_cast<int64_t>(col_starts.size()) == count &&
                  static_cast<int64_t>(scales.size()) == count,
              "lora_shrink_expand: a, b, row_starts, row_ends, col_starts and scales must have "
              "one entry per segment; got ",
              count, ", ", b.size(), ", ", row_starts.size(), ", ", row_ends.size(), ", ",
              col_starts.size(), ", ", scales.size());
  if (count == 0) return;
  const int64_t m = x.size(0), k_dim = x.size(1), n_dim = out.size(1);
  std::vector<Segment> segments;
  segments.reserve(count);
  for (int64_t s = 0; s < count; ++s) {
    const at::Tensor& as = a[s];
    const at::Tensor& bs = b[s];
    TORCH_CHECK(as.dim() == 2 && bs.dim() == 2 && as.size(1) == k_dim &&
                    bs.size(1) == as.size(0),
                "lora_shrink_expand: segment ", s, ": a must be [rank, ", k_dim,
                "] and b [n, rank]; got a ", as.sizes(), " and b ", bs.sizes());
    TORCH_CHECK(is_float_or_bf16(as) && bs.scalar_type() == as.scalar_type() &&
                    as.is_contiguous() && bs.is_contiguous() && as.device() == x.device() &&
                    bs.device() == x.device(),
                "lora_shrink_expand: segment ", s, ": a and b must be contiguous, both float32 "
                "or both bfloat16, on x's device; got ", as.scalar_type(), " and ",
                bs.scalar_type());
    TORCH_CHECK(0 <= row_starts[s] && row_starts[s] <= row_ends[s] && row_ends[s] <= m,
                "lora_shrink_expand: segment ", s, ": rows ", row_starts[s], ":", row_ends[s],
                " are not within x's ", m, " rows");
    TORCH_CHECK(0 <= col_starts[s] && col_starts[s] + bs.size(0) <= n_dim,
                "lora_shrink_expand: segment ", s, ": columns ", col_starts[s], ":",
                col_starts[s] + bs.size(0), " are not within out's ", n_dim, " columns");
    segments.push_back(Segment{as.data_ptr(), bs.data_ptr(), row_starts[s], row_ends[s],
                               col_starts[s], bs.size(0), as.size(0),
                               static_cast<float>(scales[s]),
                               as.scalar_type() == at::kBFloat16, false, 0, 0, 0});
  }
  // every output element is written by one segment at most (tasks run side by side)
  for (int64_t s = 0; s < count; ++s)
    for (int64_t o = 0; o < s; ++o) {
      const Segment& p = segments[s];
      const Segment& q = segments[o];
      const bool rows = std::max(p.rows_start, q.rows_start) < std::min(p.rows_end, q.rows_end);
      const bool cols =
          std::max(p.col_start, q.col_start) < std::min(p.col_start + p.n, q.col_start + q.n);
      TORCH_CHECK(!(rows && cols), "lora_shrink_expand: segments ", o, " and ", s,
                  " update the same outputs (rows ", q.rows_start, ":", q.rows_end, " and ",
                  p.rows_start, ":", p.rows_end, ", columns ", q.col_start, ":",
                  q.col_start + q.n, " and ", p.col_start, ":", p.col_start + p.n, ")");
    }
  if (x.scalar_type() == at::kBFloat16) {
    run<uint16_t>(out, x, segments);
  } else {
    run<float>(out, x, segments);
  }
}
