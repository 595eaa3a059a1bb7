// Weight-only quantized linear layers for CPU: the weights stay 4 or 8 bits plus per-group
// scales (and mins) in memory and are expanded to fp32 inside the dot products, so a decode step
// reads about the quantized bytes, not 4x them (it is bound by memory bandwidth).
//
// Layouts (row n = output feature, K = input features, G = group size along K):
//   w4: qdata uint8 [N, K / 2]; inside each group of 32, byte j holds element j in its low nibble
//       and element j + 16 in its high nibble (GGUF's Q4_0/Q4_1 order); value = scale * q + min.
//   w8: qdata int8 [N, K]; value = scale * q (+ min when mins are given); G = 16 or 32.
//   scales, mins: [N, K / G], fp16 or fp32.
//
// Two paths, chosen by the caller: a fused kernel for few activation rows (decode, speculative
// verification, a few streams), where each weight group is expanded once into registers and
// multiplied with up to 8 rows; and a dequantize kernel that writes the dense weight (fp32 or
// bf16) for a BLAS matmul when many rows (prefill, embeddings) make FLOPs, not bytes, the bound.
//
// Compiled at first use by torch.utils.cpp_extension with -O3 -march=native (see __init__.py):
// AVX-512 and AVX2+FMA paths in intrinsics (the auto-vectorizer kept the accumulators in memory
// and ran 3x slower), and a portable scalar path for other CPUs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <immintrin.h>

#include "include/bf16_bits.h"
#include "include/ops.h"

namespace {

inline float to_float(float v) { return v; }
#if defined(__F16C__)
inline float to_float(c10::Half v) { return _cvtsh_ss(v.x); }
#else
inline float to_float(c10::Half v) { return static_cast<float>(v); }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CENOTE_VEC 1
// A 4-bit group's 16 bytes split into low nibbles (elements 0-15) and high (16-31), as bytes.
inline void nibbles(const uint8_t* qg, __m128i& lo, __m128i& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(bytes, mask);
  hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
}

// Vec: the vector ISA's register of fp32 lanes and the operations the matmul loop below is
// written against, once for both ISAs. The operations both spell alike but for the
// intrinsics' prefix P (_mm512 / _mm256) come from this macro: REG holds LANES fp32 values,
// BYTES loads LANES int8 weights into the low bytes of an __m128i.
#define CENOTE_VEC_OPS(P, REG, LANES, BYTES)                                               \
  using T = REG;                                                                           \
  static constexpr int kLanes = LANES;                                                     \
  static T zero() { return P##_setzero_ps(); }                                             \
  static T set1(float v) { return P##_set1_ps(v); }                                        \
  static T load(const float* p) { return P##_loadu_ps(p); }                                \
  static T mul(T a, T b) { return P##_mul_ps(a, b); }                                      \
  static T add(T a, T b) { return P##_add_ps(a, b); }                                      \
  static T fmadd(T a, T b, T c) { return P##_fmadd_ps(a, b, c); }                          \
  /* LANES unsigned bytes (nibbles) / LANES int8 weights as fp32 */                        \
  static T from_u8(__m128i b) { return P##_cvtepi32_ps(P##_cvtepu8_epi32(b)); }            \
  static T load_i8(const int8_t* p) {                                                      \
    return P##_cvtepi32_ps(P##_cvtepi8_epi32(BYTES(reinterpret_cast<const __m128i*>(p)))); \
  }
#endif

#if defined(__AVX512F__)
// 16 lanes: a 32-weight group is two registers.
struct Vec {
  CENOTE_VEC_OPS(_mm512, __m512, 16, _mm_loadu_si128)
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  // One 4-bit group as fp32 weights 0-15, 16-31, before scale and min.
  static void w4_unpack(const uint8_t* qg, T* w) {
    __m128i lo, hi;
    nibbles(qg, lo, hi);
    w[0] = from_u8(lo);
    w[1] = from_u8(hi);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
// 8 lanes: a 32-weight group is four registers.
struct Vec {
  CENOTE_VEC_OPS(_mm256, __m256, 8, _mm_loadl_epi64)
  static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // One 4-bit group as fp32 weights 0-7, 8-15, 16-23, 24-31.
  static void w4_unpack(const uint8_t* qg, T* w) {
    __m128i lo, hi;
    nibbles(qg, lo, hi);
    w[0] = from_u8(lo);
    w[1] = from_u8(_mm_srli_si128(lo, 8));
    w[2] = from_u8(hi);
    w[3] = from_u8(_mm_srli_si128(hi, 8));
  }
};
#endif
#undef CENOTE_VEC_OPS

// The row kernels below are inlined into the loop over output rows by force: left to GCC's
// heuristics, which instantiations it inlined changed with the code's shape and cost up to 15%.
#define CENOTE_INLINE inline __attribute__((always_inline))

// sum_g min_g * sum(x_g) for each of MB activation rows (0 without mins).
template <typename S, bool HAS_MIN, int MB>
inline void min_terms(const float* xsum, int64_t groups, const S* mn, float* macc) {
  for (int m = 0; m < MB; ++m) macc[m] = 0.f;
  if (!HAS_MIN) return;
  for (int m = 0; m < MB; ++m) {
    const float* xs = xsum + m * groups;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t g = 0; g < groups; ++g) s += to_float(mn[g]) * xs[g];
    macc[m] = s;
  }
}

// Sums of each activation row over each group (the min term: sum_j x_j * (d q_j + m)
// = sum_j x_j d q_j + m * sum_j x_j).
// (A plain loop: at::sum's dispatch costs more than the work at decode sizes.)
at::Tensor group_sums(const at::Tensor& x, int64_t group) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / group;
  at::Tensor out = at::empty({M, groups}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < M * groups; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < group; ++j) s += xp[i * group + j];
    op[i] = s;
  }
  return out;
}

// Ask for the bytes of a row a few rows ahead: the rows are streamed from memory once per
// step, and the hardware prefetcher alone left the decode matmuls at half the bandwidth.
constexpr int64_t kPrefetchRows = 4;
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// A block is NB output rows (q: the first one's bytes, the next at ldq; scale, mn: its groups,
// the next at ``groups``) against MB activation rows (x, leading dimension ldx); out[m * ldo + r].
// Every output value is computed by the same operations in the same order whatever the block's
// shape, so a row's result does not depend on how many rows share its step.
//
// 4-bit weights (dequant_block): each group is dequantized once into registers (scale * q + min,
// the values ``quant_dequantize`` writes) and meets all MB rows with one fused multiply-add per
// register: out = sum_k w_k x_k. 8-bit weights (scaled_block): each row's products with the
// unscaled integers are summed per group, then scaled: out = sum_g scale_g (q_g . x_g) + min
// terms. The 8-bit expansion costs more than the per-row work it would save, so it keeps the
// per-row scale (docs/performance.md, "an fp32 row kernel for several rows").
#if defined(CENOTE_VEC)
// Group g of a row's BITS-bit weights (q: the row's bytes) as G / kLanes registers in element
// order, before scale and min.
template <int BITS, int G>
CENOTE_INLINE void expand_group(const uint8_t* q, int64_t g, Vec::T* w) {
  if constexpr (BITS == 4) {
    Vec::w4_unpack(q + g * 16, w);
  } else {
    const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * G;
    for (int i = 0; i < G / Vec::kLanes; ++i) w[i] = Vec::load_i8(qg + Vec::kLanes * i);
  }
}

template <typename S, bool HAS_MIN, int MB, int NB>
CENOTE_INLINE void dequant_block(const float* x, int64_t ldx, const float*, int64_t groups,
                                 const uint8_t* q, int64_t ldq, const S* scale, const S* mn,
                                 float* out, int64_t ldo) {
  constexpr int R = 32 / Vec::kLanes;
  Vec::T acc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = Vec::zero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec::T w[NB][R];
    for (int r = 0; r < NB; ++r) {
      expand_group<4, 32>(q + r * ldq, g, w[r]);
      const Vec::T d = Vec::set1(to_float(scale[r * groups + g]));
      const Vec::T mv = Vec::set1(HAS_MIN ? to_float(mn[r * groups + g]) : 0.f);
      for (int i = 0; i < R; ++i) w[r][i] = HAS_MIN ? Vec::add(Vec::mul(w[r][i], d), mv)
                                                    : Vec::mul(w[r][i], d);
    }
    for (int i = 0; i < R; ++i) {
      for (int m = 0; m < MB; ++m) {
        const Vec::T xv = Vec::load(x + m * ldx + g * 32 + Vec::kLanes * i);
        for (int r = 0; r < NB; ++r) acc[r][m] = Vec::fmadd(w[r][i], xv, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[m * ldo + r] = Vec::hsum(acc[r][m]);
}

template <typename S, bool HAS_MIN, int G, int MB, int NB>
CENOTE_INLINE void scaled_block(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                                const uint8_t* q, int64_t ldq, const S* scale, const S* mn,
                                float* out, int64_t ldo) {
  constexpr int R = G / Vec::kLanes;
  Vec::T acc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = Vec::zero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec::T w[NB][R], d[NB];
    for (int r = 0; r < NB; ++r) {
      expand_group<8, G>(q + r * ldq, g, w[r]);
      d[r] = Vec::set1(to_float(scale[r * groups + g]));
    }
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * G;
      Vec::T xv[R];
      for (int i = 0; i < R; ++i) xv[i] = Vec::load(xg + Vec::kLanes * i);
      for (int r = 0; r < NB; ++r) {
        Vec::T t = Vec::mul(w[r][0], xv[0]);
        for (int i = 1; i < R; ++i) t = Vec::fmadd(w[r][i], xv[i], t);
        acc[r][m] = Vec::fmadd(t, d[r], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NB; ++r) {
    float macc[MB];
    min_terms<S, HAS_MIN, MB>(xsum, groups, HAS_MIN ? mn + r * groups : nullptr, macc);
    for (int m = 0; m < MB; ++m) out[m * ldo + r] = Vec::hsum(acc[r][m]) + macc[m];
  }
}
#else
// The same without vectors.
template <typename S, bool HAS_MIN, int MB, int NB>
CENOTE_INLINE void dequant_block(const float* x, int64_t ldx, const float*, int64_t groups,
                                 const uint8_t* q, int64_t ldq, const S* scale, const S* mn,
                                 float* out, int64_t ldo) {
  float acc[NB][MB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < NB; ++r) {
      const uint8_t* qg = q + r * ldq + g * 16;
      const float d = to_float(scale[r * groups + g]);
      const float mv = HAS_MIN ? to_float(mn[r * groups + g]) : 0.f;
      float w[32];
      for (int j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(qg[j] & 0x0F) + mv;
        w[j + 16] = d * static_cast<float>(qg[j] >> 4) + mv;
      }
      for (int m = 0; m < MB; ++m) {
        const float* xg = x + m * ldx + g * 32;
        for (int j = 0; j < 32; ++j) acc[r][m] += w[j] * xg[j];
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[m * ldo + r] = acc[r][m];
}

template <typename S, bool HAS_MIN, int G, int MB, int NB>
CENOTE_INLINE void scaled_block(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                                const uint8_t* q, int64_t ldq, const S* scale, const S* mn,
                                float* out, int64_t ldo) {
  for (int r = 0; r < NB; ++r) {
    const int8_t* qr = reinterpret_cast<const int8_t*>(q + r * ldq);
    float macc[MB], acc[MB] = {};
    min_terms<S, HAS_MIN, MB>(xsum, groups, HAS_MIN ? mn + r * groups : nullptr, macc);
    for (int64_t g = 0; g < groups; ++g) {
      const float d = to_float(scale[r * groups + g]);
      for (int m = 0; m < MB; ++m) {
        const float* xg = x + m * ldx + g * G;
        float t = 0.f;
        for (int j = 0; j < G; ++j) t += static_cast<float>(qr[g * G + j]) * xg[j];
        acc[m] += d * t;
      }
    }
    for (int m = 0; m < MB; ++m) out[m * ldo + r] = acc[m] + macc[m];
  }
}
#endif

// Output rows a block takes: two keep two independent accumulator chains per activation row
// (one alone left few-row steps waiting on the fused multiply-add latency); with AVX2's 16
// registers, two of more than 4 rows spill (docs/performance.md).
constexpr int kMaxRowTile = 8;  // activation rows a block takes
inline bool pair_output_rows(int64_t M) {
#if defined(__AVX512F__)
  return true;
#elif defined(CENOTE_VEC)
  return M <= 4;
#else
  (void)M;
  return false;
#endif
}

// NB output rows (from q, scale, mn) against all M activation rows, kMaxRowTile at a time.
template <typename S, bool HAS_MIN, int BITS, int G, int NB>
CENOTE_INLINE void block_rows(const float* x, int64_t M, int64_t K, const float* xsum,
                              const uint8_t* q, int64_t ldq, const S* scale, const S* mn,
                              float* out, int64_t N) {
  const int64_t groups = K / G;
  auto block = [&](auto rows, int64_t m) {
    constexpr int MB = decltype(rows)::value;
    const float* xs = HAS_MIN && BITS == 8 ? xsum + m * groups : nullptr;
    if constexpr (BITS == 4) {
      dequant_block<S, HAS_MIN, MB, NB>(x + m * K, K, xs, groups, q, ldq, scale, mn,
                                        out + m * N, N);
    } else {
      scaled_block<S, HAS_MIN, G, MB, NB>(x + m * K, K, xs, groups, q, ldq, scale, mn,
                                          out + m * N, N);
    }
  };
  int64_t m = 0;
  for (; m + kMaxRowTile <= M; m += kMaxRowTile) block(std::integral_constant<int, 8>{}, m);
  switch (M - m) {
    case 7: block(std::integral_constant<int, 7>{}, m); break;
    case 6: block(std::integral_constant<int, 6>{}, m); break;
    case 5: block(std::integral_constant<int, 5>{}, m); break;
    case 4: block(std::integral_constant<int, 4>{}, m); break;
    case 3: block(std::integral_constant<int, 3>{}, m); break;
    case 2: block(std::integral_constant<int, 2>{}, m); break;
    case 1: block(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// out [M, N] = x [M, K] @ dequant(q).T for a BITS-bit weight in groups of G: output rows taken
// NB at a time (the last one alone), each against all rows of x.
template <typename S, bool HAS_MIN, int BITS, int G, int NB>
void quant_matmul_blocks(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor* mn, at::Tensor& out) {
  constexpr bool kSums = HAS_MIN && BITS == 8;  // the 8-bit min terms need the group sums
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K / G, row_bytes = K * BITS / 8;
  at::Tensor xsum = kSums ? group_sums(x, G) : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* xs = kSums ? xsum.data_ptr<float>() : nullptr;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(NB, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NB <= n1; n += NB) {
      if (n + kPrefetchRows + NB <= n1) {
        prefetch(qp + (n + kPrefetchRows) * row_bytes, NB * row_bytes);
        prefetch(sp + (n + kPrefetchRows) * groups, NB * groups * sizeof(S));
        if (HAS_MIN) prefetch(mp + (n + kPrefetchRows) * groups, NB * groups * sizeof(S));
      }
      block_rows<S, HAS_MIN, BITS, G, NB>(xp, M, K, xs, qp + n * row_bytes, row_bytes,
                                          sp + n * groups, HAS_MIN ? mp + n * groups : nullptr,
                                          op + n, N);
    }
    for (; n < n1; ++n)
      block_rows<S, HAS_MIN, BITS, G, 1>(xp, M, K, xs, qp + n * row_bytes, row_bytes,
                                         sp + n * groups, HAS_MIN ? mp + n * groups : nullptr,
                                         op + n, N);
  });
}

template <typename S, bool HAS_MIN, int BITS, int G>
void quant_matmul_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const at::Tensor* mn, at::Tensor& out) {
  if (pair_output_rows(x.size(0))) {
    quant_matmul_blocks<S, HAS_MIN, BITS, G, 2>(x, q, scale, mn, out);
  } else {
    quant_matmul_blocks<S, HAS_MIN, BITS, G, 1>(x, q, scale, mn, out);
  }
}

template <typename S, bool HAS_MIN>
void quant_matmul_layout(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor* mn, int64_t bits, int64_t group, at::Tensor& out) {
  if (bits == 4) {
    quant_matmul_rows<S, HAS_MIN, 4, 32>(x, q, scale, mn, out);
  } else if (group == 16) {
    quant_matmul_rows<S, HAS_MIN, 8, 16>(x, q, scale, mn, out);
  } else {
    quant_matmul_rows<S, HAS_MIN, 8, 32>(x, q, scale, mn, out);
  }
}

void check_args(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 8 || group == 32, "4-bit weights use groups of 32, got ", group);
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32, got ", group);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % group == 0, "K=", K, " is not a multiple of the group size ", group);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "qdata must be a contiguous 2-d tensor");
  TORCH_CHECK(q.size(1) == (bits == 4 ? K / 2 : K), "qdata has ", q.size(1),
              " columns for K=", K, " at ", bits, " bits");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "qdata must be uint8 (4-bit) or int8 (8-bit)");
  TORCH_CHECK(scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == q.size(0) &&
                  scale.size(1) == K / group,
              "scales must be a contiguous [N, K / group] tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf,
              "scales must be fp32 or fp16");
  if (mn.has_value()) {
    TORCH_CHECK(mn->sizes() == scale.sizes() && mn->scalar_type() == scale.scalar_type() &&
                    mn->is_contiguous(),
                "mins must match the scales' shape and dtype");
  }
}

}  // namespace

at::Tensor quant_matmul_fp32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group);

#if defined(__AVX512BF16__)
at::Tensor quant_matmul_w4_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& mn);
#endif

// out [M, N] = x [M, K] @ dequant(w).T in x's dtype: fp32, or bf16 (the fp32 result rounded
// once to bf16 as torch's cast rounds). A bf16 caller so needs no dtype conversions around the
// call: two dispatched torch ops per projection, 240 per one-stream SmolLM2 decode step
// (measured: 142-147 -> 149-151 tok/s). bf16 rows times 4-bit weights take the bf16 row kernel
// where AVX512-BF16 runs (quant_matmul_w4_bf16: the same exact products, summed in another
// order); other bf16 rows are widened to fp32 for the fp32 kernel.
at::Tensor quant_matmul(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  at::Tensor x = x_in;
  if (bf16) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "x must be a contiguous [M, K] tensor");
#if defined(__AVX512BF16__)
    if (bits == 4 && group == 32) return quant_matmul_w4_bf16(x_in, q, scale, mn);
#endif
    x = at::empty(x_in.sizes(), x_in.options().dtype(at::kFloat));
    const auto* src = reinterpret_cast<const uint16_t*>(x_in.const_data_ptr());
    float* dst = x.mutable_data_ptr<float>();
    const int64_t n = x_in.numel();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = cenote_bf16::bf16_to_float(src[i]);
  }
  at::Tensor out = quant_matmul_fp32(x, q, scale, mn, bits, group);
  if (!bf16) return out;
  at::Tensor rounded = at::empty(out.sizes(), x_in.options());
  const float* src = out.const_data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(rounded.mutable_data_ptr());
  const int64_t n = out.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = cenote_bf16::float_to_bf16(src[i]);
  return rounded;
}

// out [M, N] fp32 = x [M, K] fp32 @ dequant(w).T
at::Tensor quant_matmul_fp32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  check_args(x, q, scale, mn, bits, group);
  at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
  if (half) {
    mp ? quant_matmul_layout<c10::Half, true>(x, q, scale, mp, bits, group, out)
       : quant_matmul_layout<c10::Half, false>(x, q, scale, mp, bits, group, out);
  } else {
    mp ? quant_matmul_layout<float, true>(x, q, scale, mp, bits, group, out)
       : quant_matmul_layout<float, false>(x, q, scale, mp, bits, group, out);
  }
  return out;
}

namespace {

// 16 fp32 values -> dst (fp32, or bf16 rounded to nearest even as torch's cast does)
#if defined(__AVX512F__)
inline void store16(__m512 v, float* dst) { _mm512_storeu_ps(dst, v); }
inline void store16(__m512 v, c10::BFloat16* dst) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}
#endif

inline void store_group(const float* v, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = v[j];
}
inline void store_group(const float* v, int64_t n, c10::BFloat16* dst) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < n; ++j) {  // round to nearest even, as torch's fp32 -> bf16 cast
    uint32_t bits;
    std::memcpy(&bits, v + j, 4);
    out[j] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

template <typename S, typename T, bool HAS_MIN>
void dequant_rows(const at::Tensor& q, const at::Tensor& scale, const at::Tensor* mn,
                  int64_t bits, int64_t group, int64_t K, at::Tensor& out) {
  const int64_t N = q.size(0), groups = K / group;
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  T* op = out.data_ptr<T>();
  const uint8_t* q4 = bits == 4 ? q.data_ptr<uint8_t>() : nullptr;
  const int8_t* q8 = bits == 8 ? q.data_ptr<int8_t>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float v[32];
    for (int64_t n = n0; n < n1; ++n) {
      T* row = op + n * K;
      for (int64_t g = 0; g < groups; ++g) {
        const float d = to_float(sp[n * groups + g]);
        const float m = HAS_MIN ? to_float(mp[n * groups + g]) : 0.f;
#if defined(__AVX512F__)
        const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
        if (bits == 4) {
          __m512 w[2];
          Vec::w4_unpack(q4 + n * (K / 2) + g * 16, w);
          store16(_mm512_add_ps(_mm512_mul_ps(w[0], dv), mv), row + g * 32);
          store16(_mm512_add_ps(_mm512_mul_ps(w[1], dv), mv), row + g * 32 + 16);
        } else {
          const int8_t* qg = q8 + n * K + g * group;
          for (int64_t i = 0; i < group; i += 16) {
            const __m512 w = Vec::load_i8(qg + i);
            store16(_mm512_add_ps(_mm512_mul_ps(w, dv), mv), row + g * group + i);
          }
        }
        continue;
#endif
        if (bits == 4) {
          const uint8_t* qg = q4 + n * (K / 2) + g * 16;
          for (int j = 0; j < 16; ++j) v[j] = d * static_cast<float>(qg[j] & 0x0F) + m;
          for (int j = 0; j < 16; ++j) v[j + 16] = d * static_cast<float>(qg[j] >> 4) + m;
        } else {
          const int8_t* qg = q8 + n * K + g * group;
          for (int64_t j = 0; j < group; ++j) v[j] = d * static_cast<float>(qg[j]) + m;
        }
        store_group(v, group, row + g * group);
      }
    }
  });
}

template <typename S, typename T>
void dequant_dispatch_min(const at::Tensor& q, const at::Tensor& scale, const at::Tensor* mn,
                          int64_t bits, int64_t group, int64_t K, at::Tensor& out) {
  mn ? dequant_rows<S, T, true>(q, scale, mn, bits, group, K, out)
     : dequant_rows<S, T, false>(q, scale, mn, bits, group, K, out);
}

}  // namespace

// The dense [N, K] weight in fp32 or bf16 (rows of indices ``rows`` when given: embeddings).
// ``out`` (optional): a contiguous buffer of at least N * K elements of ``dtype`` to write into
// (a reused workspace: a fresh multi-MB allocation costs more in page faults than the work).
at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group,
                            at::ScalarType dtype, const c10::optional<at::Tensor>& buffer) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to fp32 or bf16");
  const int64_t K = bits == 4 ? q.size(1) * 2 : q.size(1);
  at::Tensor probe = at::empty({1, K}, q.options().dtype(at::kFloat));
  check_args(probe, q, scale, mn, bits, group);
  at::Tensor out;
  if (buffer.has_value()) {
    TORCH_CHECK(buffer->scalar_type() == dtype && buffer->is_contiguous() &&
                    buffer->numel() >= q.size(0) * K,
                "buffer must be a contiguous ", dtype, " tensor of at least N * K elements");
    out = buffer->view({-1}).narrow(0, 0, q.size(0) * K).view({q.size(0), K});
  } else {
    out = at::empty({q.size(0), K}, q.options().dtype(dtype));
  }
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
  if (dtype == at::kFloat) {
    half ? dequant_dispatch_min<c10::Half, float>(q, scale, mp, bits, group, K, out)
         : dequant_dispatch_min<float, float>(q, scale, mp, bits, group, K, out);
  } else {
    half ? dequant_dispatch_min<c10::Half, c10::BFloat16>(q, scale, mp, bits, group, K, out)
         : dequant_dispatch_min<float, c10::BFloat16>(q, scale, mp, bits, group, K, out);
  }
  return out;
}

namespace {

#if defined(__AVX512BF16__)
// The bf16 dot-product kernel (quant_matmul_dot below). A group of 32 weights is dequantized
// once, as the dense bf16 copy holds it (scale * q + min in fp32, rounded to bf16), into one
// register, which then meets every activation row with one vdpbf16ps each: the products are
// exact and summed in fp32. The lanes hold partial sums over K; reduce16 turns 16 of them into
// one register of 16 sums.
template <typename S, bool HAS_MIN, int BITS>
CENOTE_INLINE __m512bh dot_group(const uint8_t* q, int64_t g, const S* scale, const S* mn) {
  const __m512 d = _mm512_set1_ps(to_float(scale[g]));
  if constexpr (BITS == 4) {
    // 16 possible values: scale * v + min for v = 0..15, rounded to bf16 once, then looked up
    // by the 32 nibbles: the same values as converting each weight, and measured on Zen 4
    // (SmolLM2 layers, us a layer) 367 -> 311 at 8 rows, 522 -> 462 at 16, 922 -> 887 at 32
    const __m512 v = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 values = _mm512_mul_ps(v, d);
    if constexpr (HAS_MIN) values = _mm512_add_ps(values, _mm512_set1_ps(to_float(mn[g])));
    const __m256i table = (__m256i)_mm512_cvtneps_pbh(values);
    __m128i lo, hi;
    nibbles(q + g * 16, lo, hi);
    const __m512i index = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    return (__m512bh)_mm512_permutexvar_epi16(index, _mm512_castsi256_si512(table));
  }
  __m512 lo, hi;
  {
    const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * 32;
    lo = Vec::load_i8(qg);
    hi = Vec::load_i8(qg + 16);
  }
  lo = _mm512_mul_ps(lo, d);
  hi = _mm512_mul_ps(hi, d);
  if constexpr (HAS_MIN) {
    const __m512 m = _mm512_set1_ps(to_float(mn[g]));
    lo = _mm512_add_ps(lo, m);
    hi = _mm512_add_ps(hi, m);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
}

// v[0..15] -> one register whose lane 4 * (i % 4) + i / 4 is the sum of v[i]'s lanes: a tree
// of 128-bit and 32-bit shuffles and adds, 45 operations for 16 sums.
CENOTE_INLINE __m512 reduce16(const __m512* v) {
  __m512 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // chunks 0-1: v[2i], 2-3: v[2i + 1]
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // chunk j: v[4i + j]
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // chunk j, lanes 0-1: v[8i + j], lanes 2-3: v[8i + 4 + j]
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88),
                       _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
}

// Columns are taken 4 at a time: their groups are dequantized once into an L1 buffer, then
// meet the rows 4 at a time, 16 accumulators (row i, column j: v[4i + j]), so each activation
// load feeds 4 dot products (one load per product left the loop bound by loads: 2 cycles a
// product against 1 for the instruction itself, AMD EPYC Zen 4).
constexpr int kDotCols = 4;

// MB (<= 4) rows of x (bf16 bits, leading dimension K) against the buffered columns:
// out[i * N + j] as bf16 for the cols (<= 4) columns that exist.
template <int MB>
CENOTE_INLINE void dot_rows(const uint16_t* x, int64_t K, const __m512bh* buf, uint16_t* out,
                            int64_t N, int cols) {
  const int64_t groups = K / 32;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512bh* w = buf + g * kDotCols;
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + g * 32);
      for (int j = 0; j < kDotCols; ++j)
        acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], w[j], xv);
    }
  }
  alignas(64) uint16_t sums[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), (__m256i)_mm512_cvtneps_pbh(reduce16(acc)));
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < cols; ++j) out[i * N + j] = sums[4 * j + i];  // v[4i + j]'s lane
}

template <typename S, bool HAS_MIN, int BITS>
void quant_dot_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                    const at::Tensor* mn, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K / 32, row_bytes = K * BITS / 8;
  const int64_t blocks = (N + kDotCols - 1) / kDotCols;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(K, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<__m512bh> buffer(groups * kDotCols);
    __m512bh* buf = buffer.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kDotCols;
      const int cols = static_cast<int>(std::min<int64_t>(kDotCols, N - n0));
      if (b + 1 < b1) {  // the next block's bytes, while this one computes
        const int64_t next = (b + 1) * kDotCols, count = std::min<int64_t>(kDotCols, N - next);
        prefetch(qp + next * row_bytes, count * row_bytes);
        prefetch(sp + next * groups, count * groups * sizeof(S));
        if (HAS_MIN) prefetch(mp + next * groups, count * groups * sizeof(S));
      }
      for (int j = 0; j < kDotCols; ++j) {
        if (j >= cols) {
          for (int64_t g = 0; g < groups; ++g)
            buf[g * kDotCols + j] = (__m512bh)_mm512_setzero_si512();
          continue;
        }
        const int64_t n = n0 + j;
        const uint8_t* qn = qp + n * row_bytes;
        const S* sn = sp + n * groups;
        const S* mnn = HAS_MIN ? mp + n * groups : nullptr;
        for (int64_t g = 0; g < groups; ++g)
          buf[g * kDotCols + j] = dot_group<S, HAS_MIN, BITS>(qn, g, sn, mnn);
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(xp + m * K, K, buf, op + m * N + n0, N, cols);
      switch (M - m) {
        case 3:
          dot_rows<3>(xp + m * K, K, buf, op + m * N + n0, N, cols);
          break;
        case 2:
          dot_rows<2>(xp + m * K, K, buf, op + m * N + n0, N, cols);
          break;
        case 1:
          dot_rows<1>(xp + m * K, K, buf, op + m * N + n0, N, cols);
          break;
        default:
          break;
      }
    }
  });
}

template <typename S>
void quant_dot_layout(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const at::Tensor* mn, int64_t bits, at::Tensor& out) {
  if (bits == 4) {
    mn ? quant_dot_rows<S, true, 4>(x, q, scale, mn, out)
       : quant_dot_rows<S, false, 4>(x, q, scale, mn, out);
  } else {
    mn ? quant_dot_rows<S, true, 8>(x, q, scale, mn, out)
       : quant_dot_rows<S, false, 8>(x, q, scale, mn, out);
  }
}

// The bf16 row kernel for 4-bit weights in groups of 32 (quant_matmul of a few bf16 rows:
// decode). A nibble q becomes the bf16 number 16 + q by bit operations alone (the exponent of
// 16, q in the top 4 of the 7 mantissa bits), so vdpbf16ps multiplies it by a bf16 activation
// exactly (at most 13 significant bits a product) and sums in fp32, with no conversion
// instructions; the 16 x terms come back out with the min term:
//   sum_j x_j (d q_j + m) = d sum_j x_j (16 + q_j) + (m - 16 d) sum_j x_j.
// Groups are taken in pairs: their 32 bytes widen to 32 words whose low nibbles are elements
// 0-15 of both groups and whose high nibbles are elements 16-31, so the activations are
// rearranged once per call to match (XL: 0-15 of both, XH: 16-31 of both); a dot product's
// lanes 0-7 then hold the first group's partial sums and lanes 8-15 the second's. Against the
// fp32 kernel (each nibble widened to fp32: 12 vector operations a group) this is about 5.
constexpr int kW4Rows = 4;

// A row's scales (or mins) as fp32, zero from ``groups`` up to ``padded`` (a multiple of 16).
CENOTE_INLINE void widen(const c10::Half* p, int64_t groups, int64_t padded, float* out) {
  for (int64_t g = 0; g < padded; g += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, groups - g));
    const __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);
    _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p + g)));
  }
}
CENOTE_INLINE void widen(const float* p, int64_t groups, int64_t padded, float* out) {
  for (int64_t g = 0; g < padded; g += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, groups - g));
    const __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);
    _mm512_storeu_ps(out + g, _mm512_maskz_loadu_ps(k, p + g));
  }
}

// One pair of groups (32 bytes at q; only the first 16 when ``single``) as the bf16 words
// 16 + q: elements 0-15 of both groups (lo), 16-31 (hi).
CENOTE_INLINE void w4_pair(const uint8_t* q, bool single, __m512bh& lo, __m512bh& hi) {
  const __m256i bytes =
      single ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))
             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i mask = _mm512_set1_epi16(0x78), magic = _mm512_set1_epi16(0x4180);
  // (a & mask) | magic: the nibble in mantissa bits 3-6 of bf16 16.0
  lo = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 3), mask, magic, 0xEA);
  hi = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 1), mask, magic, 0xEA);
}

// The sums of 4 registers' lanes, in lanes 0, 4, 8 and 12: one tree (each 128-bit chunk of the
// result holds one register's partial sums, then each chunk's 4 lanes are added), so a row
// sums in the same order whichever block it is in (fewer than 4 rows: zeros for the rest).
CENOTE_INLINE __m512 reduce4(const __m512* v) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44),
                                  _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44),
                                  _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  return _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
}

// NB output rows against MB activation rows: xb holds each activation row's pairs (XL, XH),
// xsum its group sums (zero-padded to gpad); q, d, mn point at the first output row's bytes and
// its fp32 scales and mins (the next rows at ldq and gpad). Several output rows at a time keep
// several independent accumulator chains in flight (one alone left the loop waiting on the
// fused multiply-add latency) and share one reduction tree.
template <bool HAS_MIN, int MB, int NB>
CENOTE_INLINE void w4_bf16_block(const __m512bh* xb, int64_t pairs, bool odd, const float* xsum,
                                 int64_t gpad, const uint8_t* q, int64_t ldq, const float* d,
                                 const float* mn, uint16_t* out, int64_t ldo) {
  __m512 acc[NB][MB];
  #pragma GCC unroll 4
  for (int r = 0; r < NB; ++r) {  // (m - 16 d) sum(x), lanes = groups
    #pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < gpad; g += 16) {
      const __m512 dv = _mm512_loadu_ps(d + r * gpad + g);
      const __m512 c =
          HAS_MIN ? _mm512_fnmadd_ps(_mm512_set1_ps(16.f), dv, _mm512_loadu_ps(mn + r * gpad + g))
                  : _mm512_mul_ps(_mm512_set1_ps(-16.f), dv);
      #pragma GCC unroll 4
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xsum + m * gpad + g), acc[r][m]);
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const bool single = odd && p + 1 == pairs;
    #pragma GCC unroll 4
    for (int r = 0; r < NB; ++r) {
      __m512bh lo, hi;
      w4_pair(q + r * ldq + 32 * p, single, lo, hi);
      const float* dr = d + r * gpad + 2 * p;
      const __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(dr[0]), _mm256_set1_ps(dr[1]), 1);
      #pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m512bh* xp = xb + 2 * (m * pairs + p);
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, xp[0]);
        t = _mm512_dpbf16_ps(t, hi, xp[1]);
        acc[r][m] = _mm512_fmadd_ps(t, dv, acc[r][m]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    __m512 v[4];
    for (int r = 0; r < 4; ++r) v[r] = r < NB ? acc[r][m] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce4(v));
    for (int r = 0; r < NB; ++r) out[m * ldo + r] = cenote_bf16::float_to_bf16(sums[4 * r]);
  }
}

// Rows [n, n + NB) of the weight against all M activation rows, MB at a time.
template <typename S, bool HAS_MIN, int NB>
CENOTE_INLINE void w4_bf16_rows(const __m512bh* xb, int64_t M, int64_t pairs, bool odd,
                                const float* xsum, int64_t gpad, const uint8_t* qn,
                                int64_t row_bytes, const S* sn, const S* mnn, int64_t groups,
                                float* d, float* mnf, uint16_t* out, int64_t N) {
  for (int r = 0; r < NB; ++r) {
    widen(sn + r * groups, groups, gpad, d + r * gpad);
    if (HAS_MIN) widen(mnn + r * groups, groups, gpad, mnf + r * gpad);
  }
  int64_t m = 0;
  for (; m + kW4Rows <= M; m += kW4Rows)
    w4_bf16_block<HAS_MIN, kW4Rows, NB>(xb + 2 * m * pairs, pairs, odd, xsum + m * gpad, gpad,
                                        qn, row_bytes, d, mnf, out + m * N, N);
  const __m512bh* xr = xb + 2 * m * pairs;
  const float* sr = xsum + m * gpad;
  switch (M - m) {
    case 3:
      w4_bf16_block<HAS_MIN, 3, NB>(xr, pairs, odd, sr, gpad, qn, row_bytes, d, mnf,
                                    out + m * N, N);
      break;
    case 2:
      w4_bf16_block<HAS_MIN, 2, NB>(xr, pairs, odd, sr, gpad, qn, row_bytes, d, mnf,
                                    out + m * N, N);
      break;
    case 1:
      w4_bf16_block<HAS_MIN, 1, NB>(xr, pairs, odd, sr, gpad, qn, row_bytes, d, mnf,
                                    out + m * N, N);
      break;
    default:
      break;
  }
}

template <typename S, bool HAS_MIN>
void quant_w4_bf16_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const at::Tensor* mn, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K / 32, pairs = (groups + 1) / 2, row_bytes = K / 2;
  const int64_t gpad = (groups + 15) / 16 * 16;
  const bool odd = groups % 2 == 1;
  // the rows rearranged into pairs (XL, XH), and their group sums in fp32
  std::vector<__m512bh> xb(2 * M * pairs);
  std::vector<float> xsum(M * gpad, 0.f);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t p = 0; p < pairs; ++p) {
      alignas(64) uint16_t xl[32], xh[32];
      const uint16_t* src = xp + m * K + 64 * p;
      const bool two = !(odd && p + 1 == pairs);
      for (int j = 0; j < 16; ++j) {
        xl[j] = src[j];
        xh[j] = src[16 + j];
        xl[16 + j] = two ? src[32 + j] : 0;
        xh[16 + j] = two ? src[48 + j] : 0;
      }
      xb[2 * (m * pairs + p)] = (__m512bh)_mm512_load_si512(xl);
      xb[2 * (m * pairs + p) + 1] = (__m512bh)_mm512_load_si512(xh);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += cenote_bf16::bf16_to_float(xp[m * K + 32 * g + j]);
      xsum[m * gpad + g] = s;
    }
  }
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  constexpr int kBlock = 4;  // output rows at a time
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // each block row's scales and mins as fp32 (+ 16: d[2p + 1] of an odd last pair)
    std::vector<float> buffer(2 * kBlock * gpad + 16, 0.f);
    float* d = buffer.data();
    float* mnf = d + kBlock * gpad + 16;
    const __m512bh* xr = xb.data();
    const float* sr = xsum.data();
    int64_t n = n0;
    for (; n + kBlock <= n1; n += kBlock) {
      if (n + 2 * kBlock <= n1) {  // the next block's bytes, while this one computes
        prefetch(qp + (n + kBlock) * row_bytes, kBlock * row_bytes);
        prefetch(sp + (n + kBlock) * groups, kBlock * groups * sizeof(S));
        if (HAS_MIN) prefetch(mp + (n + kBlock) * groups, kBlock * groups * sizeof(S));
      }
      w4_bf16_rows<S, HAS_MIN, kBlock>(xr, M, pairs, odd, sr, gpad, qp + n * row_bytes,
                                       row_bytes, sp + n * groups,
                                       HAS_MIN ? mp + n * groups : nullptr, groups, d, mnf,
                                       op + n, N);
    }
    for (; n < n1; ++n)
      w4_bf16_rows<S, HAS_MIN, 1>(xr, M, pairs, odd, sr, gpad, qp + n * row_bytes, row_bytes,
                                  sp + n * groups, HAS_MIN ? mp + n * groups : nullptr, groups,
                                  d, mnf, op + n, N);
  });
}
#endif

}  // namespace

// The vector extensions this build was compiled with (which of the kernels' #if branches it
// holds), e.g. "avx2 fma f16c": the tests check that each arch variant took its own branches.
std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#if defined(__AVX2__)
  isa.push_back("avx2");
#endif
#if defined(__FMA__)
  isa.push_back("fma");
#endif
#if defined(__F16C__)
  isa.push_back("f16c");
#endif
#if defined(__AVX512F__)
  isa.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  isa.push_back("avx512bw");
#endif
#if defined(__AVX512VNNI__)
  isa.push_back("avx512vnni");
#endif
#if defined(__AVX512BF16__)
  isa.push_back("avx512bf16");
#endif
  return isa;
}

// Whether quant_matmul_dot runs here: it needs AVX512-BF16's dot-product instruction.
bool quant_dot_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// out [M, N] bf16 = x [M, K] bf16 @ dequant(w).T for groups of 32, on bf16 dot products: each
// weight as the dense bf16 copy holds it (scale * q + min, rounded to bf16), the exact products
// summed in fp32, the sum rounded once to bf16. Where several rows are multiplied this beats
// the fp32 fused kernel (which expands every group again for each 4 rows) and reads a quarter
// of the bytes a dense bf16 weight does.
at::Tensor quant_matmul_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  TORCH_CHECK(quant_dot_supported(), "quant_matmul_dot needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(group == 32, "quant_matmul_dot multiplies groups of 32, got ", group);
  at::Tensor probe = at::empty({0, x.size(1)}, x.options().dtype(at::kFloat));
  check_args(probe, q, scale, mn, bits, group);
  at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
#if defined(__AVX512BF16__)
  if (x.size(0) == 0) return out;
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  scale.scalar_type() == at::kHalf ? quant_dot_layout<c10::Half>(x, q, scale, mp, bits, out)
                                   : quant_dot_layout<float>(x, q, scale, mp, bits, out);
#endif
  return out;
}

#if defined(__AVX512BF16__)
// out [M, N] bf16 = x [M, K] bf16 @ dequant(w).T for 4-bit weights in groups of 32: the exact
// products of the bf16 rows and the integer nibbles summed in fp32, scaled per group, the sum
// rounded once to bf16 (quant_w4_bf16_rows above).
at::Tensor quant_matmul_w4_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& mn) {
  at::Tensor probe = at::empty({0, x.size(1)}, x.options().dtype(at::kFloat));
  check_args(probe, q, scale, mn, 4, 32);
  at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  if (scale.scalar_type() == at::kHalf) {
    mp ? quant_w4_bf16_rows<c10::Half, true>(x, q, scale, mp, out)
       : quant_w4_bf16_rows<c10::Half, false>(x, q, scale, mp, out);
  } else {
    mp ? quant_w4_bf16_rows<float, true>(x, q, scale, mp, out)
       : quant_w4_bf16_rows<float, false>(x, q, scale, mp, out);
  }
  return out;
}
#endif
