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
// instead of 4 x 3 x 5 torch ops. x and out are fp32 or bf16 (the same dtype); the factors are
// fp32 or bf16 (all the same dtype). Everything between reading x and writing out is fp32: the
// shrink ``t = x @ a^T`` is kept in fp32 and each output element is rounded once, when it is
// added to out (torch's bf16 path rounds t, the product and the sum).
//
// Two phases, each shared among torch's threads: (1) shrink, one task per segment and block of
// kRowBlock rows; (2) expand, one task per segment and tile of kColTile output columns, whose
// factor columns are transposed once into fp32 so the tile's columns are summed side by side.
// Each row's sums run in the same order whatever the other rows of its block or segment are
// (row results do not depend on the batch). AVX-512, AVX2 + FMA or scalar code is compiled for
// the build's arch (CENOTE_KERNEL_ARCH).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
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
// below this many multiply-adds a call runs on the calling thread: waking the pool costs more
// than the work (a decode step's update is ~0.3 M)
constexpr int64_t kInlineWork = 1 << 18;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return cenote_bf16::bf16_to_float(v); }
inline void store(float& out, float v) { out = v; }
inline void store(uint16_t& out, float v) { out = cenote_bf16::float_to_bf16(v); }

// One vector of kLanes fp32 values, for the build's instruction set.
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
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vset1(float v) { return v; }
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const uint16_t* p) { return cenote_bf16::bf16_to_float(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }  // -ffp-contract=off: two roundings
inline void vstore(float* p, Vec v) { *p = v; }
#endif

// The lanes of v added in a fixed order.
inline float vsum(Vec v) {
  float lanes[kLanes];
  vstore(lanes, v);
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += lanes[i];
  return sum;
}

// One segment as the kernel reads it.
struct Segment {
  const void* a;  // [rank, K]
  const void* b;  // [n, rank]
  int64_t rows_start, rows_end, col_start, n, rank;
  float scale;
  int64_t t_offset;  // where its shrunk rows start in the fp32 buffer ([rows, rank])
};

// t[i, k] = x[i] . a[k] for rows ``rows`` (<= kRowBlock) of x: each row's sum is kLanes
// partial sums over K (vector part), added in lane order, then the tail in column order.
template <typename X, typename W>
void shrink_block(const X* x, int64_t k_dim, int64_t rows, const W* a, int64_t rank, float* t) {
  const int64_t vec_end = k_dim / kLanes * kLanes;
  for (int64_t k = 0; k < rank; ++k) {
    const W* a_row = a + k * k_dim;
    Vec acc[kRowBlock];
    for (int64_t i = 0; i < rows; ++i) acc[i] = vzero();
    for (int64_t j = 0; j < vec_end; j += kLanes) {
      const Vec w = vload(a_row + j);
      for (int64_t i = 0; i < rows; ++i) acc[i] = vfma(vload(x + i * k_dim + j), w, acc[i]);
    }
    for (int64_t i = 0; i < rows; ++i) {
      float sum = vsum(acc[i]);
      for (int64_t j = vec_end; j < k_dim; ++j) sum += to_float(x[i * k_dim + j]) * to_float(a_row[j]);
      t[i * rank + k] = sum;
    }
  }
}

// out[r, c0 + c] += scale * sum_k t[r, k] * b[c, k] for the columns [c_begin, c_end) of one
// segment, every row of it; ``bt`` is a [rank, kColTile] fp32 scratch.
template <typename X, typename W>
void expand_tile(const Segment& s, const float* t, const W* b, int64_t c_begin, int64_t c_end,
                 X* out, int64_t n_dim, float* bt) {
  const int64_t width = c_end - c_begin;
  for (int64_t c = 0; c < width; ++c)
    for (int64_t k = 0; k < s.rank; ++k) bt[k * kColTile + c] = to_float(b[(c_begin + c) * s.rank + k]);
  const int64_t vectors = width / kLanes;
  const Vec scale = vset1(s.scale);
  float sums[kColTile];
  for (int64_t r = s.rows_start; r < s.rows_end; ++r) {
    const float* t_row = t + (r - s.rows_start) * s.rank;
    Vec acc[kColTile / kLanes];
    for (int64_t v = 0; v < vectors; ++v) acc[v] = vzero();
    for (int64_t k = 0; k < s.rank; ++k) {
      const Vec tk = vset1(t_row[k]);
      const float* bt_k = bt + k * kColTile;
      for (int64_t v = 0; v < vectors; ++v) acc[v] = vfma(tk, vload(bt_k + v * kLanes), acc[v]);
    }
    for (int64_t v = 0; v < vectors; ++v) vstore(sums + v * kLanes, acc[v] * scale);
    for (int64_t c = vectors * kLanes; c < width; ++c) {
      float sum = 0.f;
      for (int64_t k = 0; k < s.rank; ++k) sum += t_row[k] * bt[k * kColTile + c];
      sums[c] = sum * s.scale;
    }
    X* out_row = out + r * n_dim + s.col_start + c_begin;
    for (int64_t c = 0; c < width; ++c) store(out_row[c], to_float(out_row[c]) + sums[c]);
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

template <typename X, typename W>
void run(at::Tensor& out, const at::Tensor& x, std::vector<Segment>& segments) {
  const int64_t k_dim = x.size(1), n_dim = out.size(1);
  const X* xs = reinterpret_cast<const X*>(x.data_ptr());
  X* outs = reinterpret_cast<X*>(out.data_ptr());
  // tasks of both phases: (segment, first row) and (segment, first column)
  std::vector<std::pair<int64_t, int64_t>> shrink_tasks, expand_tasks;
  int64_t t_size = 0, work = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s) {
    Segment& seg = segments[s];
    seg.t_offset = t_size;
    const int64_t rows = seg.rows_end - seg.rows_start;
    t_size += rows * seg.rank;
    work += rows * seg.rank * (k_dim + seg.n);
    for (int64_t r = seg.rows_start; r < seg.rows_end; r += kRowBlock) shrink_tasks.emplace_back(s, r);
    if (rows > 0)
      for (int64_t c = 0; c < seg.n; c += kColTile) expand_tasks.emplace_back(s, c);
  }
  std::vector<float> t(t_size);
  // 1) shrink: t = x[rows] @ a^T per segment
  run_tasks(static_cast<int64_t>(shrink_tasks.size()), work, [&](auto next) {
    for (int64_t i = next(); i >= 0; i = next()) {
      const auto [s, r] = shrink_tasks[i];
      const Segment& seg = segments[s];
      const int64_t rows = std::min(kRowBlock, seg.rows_end - r);
      shrink_block(xs + r * k_dim, k_dim, rows, static_cast<const W*>(seg.a), seg.rank,
                   t.data() + seg.t_offset + (r - seg.rows_start) * seg.rank);
    }
  });
  // 2) expand: out[rows, block] += scale * t @ b^T per segment and column tile
  run_tasks(static_cast<int64_t>(expand_tasks.size()), work, [&](auto next) {
    std::vector<float> bt;  // this thread's transposed factor tile
    for (int64_t i = next(); i >= 0; i = next()) {
      const auto [s, c] = expand_tasks[i];
      const Segment& seg = segments[s];
      bt.resize(seg.rank * kColTile);
      expand_tile(seg, t.data() + seg.t_offset, static_cast<const W*>(seg.b), c,
                  std::min(c + kColTile, seg.n), outs, n_dim, bt.data());
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
  const at::ScalarType factor_type = a[0].scalar_type();
  TORCH_CHECK(factor_type == at::kFloat || factor_type == at::kBFloat16,
              "lora_shrink_expand: factors must be float32 or bfloat16; got ", factor_type);
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
    TORCH_CHECK(as.scalar_type() == factor_type && bs.scalar_type() == factor_type &&
                    as.is_contiguous() && bs.is_contiguous() && as.device() == x.device() &&
                    bs.device() == x.device(),
                "lora_shrink_expand: segment ", s, ": factors must be contiguous, ",
                factor_type, " like the first, on x's device");
    TORCH_CHECK(0 <= row_starts[s] && row_starts[s] <= row_ends[s] && row_ends[s] <= m,
                "lora_shrink_expand: segment ", s, ": rows ", row_starts[s], ":", row_ends[s],
                " are not within x's ", m, " rows");
    TORCH_CHECK(0 <= col_starts[s] && col_starts[s] + bs.size(0) <= n_dim,
                "lora_shrink_expand: segment ", s, ": columns ", col_starts[s], ":",
                col_starts[s] + bs.size(0), " are not within out's ", n_dim, " columns");
    segments.push_back(Segment{as.data_ptr(), bs.data_ptr(), row_starts[s], row_ends[s],
                               col_starts[s], bs.size(0), as.size(0),
                               static_cast<float>(scales[s]), 0});
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
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool w_bf16 = factor_type == at::kBFloat16;
  if (x_bf16 && w_bf16) {
    run<uint16_t, uint16_t>(out, x, segments);
  } else if (x_bf16) {
    run<uint16_t, float>(out, x, segments);
  } else if (w_bf16) {
    run<float, uint16_t>(out, x, segments);
  } else {
    run<float, float>(out, x, segments);
  }
}
