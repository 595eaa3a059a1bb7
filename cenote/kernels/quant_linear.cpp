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
// Two paths, chosen by the caller: a fused kernel for few activation rows (decode), where each
// weight group is expanded once into registers and multiplied with up to 4 rows; and a
// dequantize kernel that writes the dense weight (fp32 or bf16) for a BLAS matmul when many rows
// (prefill, embeddings) make FLOPs, not bytes, the bound.
//
// Compiled at first use by torch.utils.cpp_extension with -O3 -march=native (see __init__.py):
// AVX-512 and AVX2+FMA paths in intrinsics (the auto-vectorizer kept the accumulators in memory
// and ran 3x slower), and a portable scalar path for other CPUs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

inline float to_float(float v) { return v; }
#if defined(__F16C__)
inline float to_float(c10::Half v) { return _cvtsh_ss(v.x); }
#else
inline float to_float(c10::Half v) { return static_cast<float>(v); }
#endif

#if defined(__AVX512F__)
// 16 lanes: a 32-weight group is two registers.
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// Weights of one 4-bit group as fp32 (elements 0-15, 16-31), before scale and min.
inline void w4_unpack(const uint8_t* qg, __m512& lo, __m512& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

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

// One output row of a 4-bit weight against MB activation rows:
// out[m] = sum_g scale_g * (q_g . x_g) + min_g * sum(x_g).
template <typename S, bool HAS_MIN, int MB>
inline void w4_row(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                   const uint8_t* q, const S* scale, const S* mn, float* out, int64_t ldo) {
  float macc[MB];
  min_terms<S, HAS_MIN, MB>(xsum, groups, mn, macc);
#if defined(__AVX512F__)
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo, hi;
    w4_unpack(q + g * 16, lo, hi);
    const __m512 d = _mm512_set1_ps(to_float(scale[g]));
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * 32;
      __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xg));
      t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), t);
      acc[m] = _mm512_fmadd_ps(t, d, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]) + macc[m];
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 d = _mm256_set1_ps(to_float(scale[g]));
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * 32;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
      acc[m] = _mm256_fmadd_ps(t, d, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]) + macc[m];
#else
  float acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * 16;
    const float d = to_float(scale[g]);
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * 32;
      float t = 0.f;
      for (int j = 0; j < 16; ++j)
        t += static_cast<float>(qg[j] & 0x0F) * xg[j] + static_cast<float>(qg[j] >> 4) * xg[j + 16];
      acc[m] += d * t;
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = acc[m] + macc[m];
#endif
}

// One output row of an 8-bit weight (group G) against MB activation rows.
template <typename S, bool HAS_MIN, int G, int MB>
inline void w8_row(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                   const int8_t* q, const S* scale, const S* mn, float* out, int64_t ldo) {
  float macc[MB];
  min_terms<S, HAS_MIN, MB>(xsum, groups, mn, macc);
#if defined(__AVX512F__)
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + g * G;
    const __m512 d = _mm512_set1_ps(to_float(scale[g]));
    __m512 w[G / 16];
    for (int i = 0; i < G / 16; ++i)
      w[i] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16 * i))));
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * G;
      __m512 t = _mm512_mul_ps(w[0], _mm512_loadu_ps(xg));
      for (int i = 1; i < G / 16; ++i) t = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(xg + 16 * i), t);
      acc[m] = _mm512_fmadd_ps(t, d, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]) + macc[m];
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + g * G;
    const __m256 d = _mm256_set1_ps(to_float(scale[g]));
    __m256 w[G / 8];
    for (int i = 0; i < G / 8; ++i)
      w[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8 * i))));
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * G;
      __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
      for (int i = 1; i < G / 8; ++i) t = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i), t);
      acc[m] = _mm256_fmadd_ps(t, d, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]) + macc[m];
#else
  float acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + g * G;
    const float d = to_float(scale[g]);
    for (int m = 0; m < MB; ++m) {
      const float* xg = x + m * ldx + g * G;
      float t = 0.f;
      for (int j = 0; j < G; ++j) t += static_cast<float>(qg[j]) * xg[j];
      acc[m] += d * t;
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = acc[m] + macc[m];
#endif
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

template <typename S, bool HAS_MIN>
void w4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
               const at::Tensor* mn, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K / 32;
  at::Tensor xsum = HAS_MIN ? group_sums(x, 32) : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* xs = HAS_MIN ? xsum.data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = qp + n * (K / 2);
      const S* sn = sp + n * groups;
      const S* mnn = HAS_MIN ? mp + n * groups : nullptr;
      if (n + kPrefetchRows < n1) {
        prefetch(qn + kPrefetchRows * (K / 2), K / 2);
        prefetch(sn + kPrefetchRows * groups, groups * sizeof(S));
        if (HAS_MIN) prefetch(mnn + kPrefetchRows * groups, groups * sizeof(S));
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        w4_row<S, HAS_MIN, 4>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups, qn,
                              sn, mnn, op + m * N + n, N);
      for (; m + 2 <= M; m += 2)
        w4_row<S, HAS_MIN, 2>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups, qn,
                              sn, mnn, op + m * N + n, N);
      for (; m < M; ++m)
        w4_row<S, HAS_MIN, 1>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups, qn,
                              sn, mnn, op + m * N + n, N);
    }
  });
}

template <typename S, bool HAS_MIN, int G>
void w8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
               const at::Tensor* mn, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K / G;
  at::Tensor xsum = HAS_MIN ? group_sums(x, G) : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* xs = HAS_MIN ? xsum.data_ptr<float>() : nullptr;
  const int8_t* qp = q.data_ptr<int8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qn = qp + n * K;
      const S* sn = sp + n * groups;
      const S* mnn = HAS_MIN ? mp + n * groups : nullptr;
      if (n + kPrefetchRows < n1) {
        prefetch(qn + kPrefetchRows * K, K);
        prefetch(sn + kPrefetchRows * groups, groups * sizeof(S));
        if (HAS_MIN) prefetch(mnn + kPrefetchRows * groups, groups * sizeof(S));
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        w8_row<S, HAS_MIN, G, 4>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups,
                                 qn, sn, mnn, op + m * N + n, N);
      for (; m + 2 <= M; m += 2)
        w8_row<S, HAS_MIN, G, 2>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups,
                                 qn, sn, mnn, op + m * N + n, N);
      for (; m < M; ++m)
        w8_row<S, HAS_MIN, G, 1>(xp + m * K, K, HAS_MIN ? xs + m * groups : nullptr, groups,
                                 qn, sn, mnn, op + m * N + n, N);
    }
  });
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

// out [M, N] fp32 = x [M, K] fp32 @ dequant(w).T
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  check_args(x, q, scale, mn, bits, group);
  at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
#define CENOTE_W8(S, HM)                                              \
  (group == 16 ? w8_matmul<S, HM, 16>(x, q, scale, mp, out)           \
               : w8_matmul<S, HM, 32>(x, q, scale, mp, out))
  if (bits == 4) {
    if (half) {
      mp ? w4_matmul<c10::Half, true>(x, q, scale, mp, out)
         : w4_matmul<c10::Half, false>(x, q, scale, mp, out);
    } else {
      mp ? w4_matmul<float, true>(x, q, scale, mp, out)
         : w4_matmul<float, false>(x, q, scale, mp, out);
    }
  } else if (half) {
    mp ? CENOTE_W8(c10::Half, true) : CENOTE_W8(c10::Half, false);
  } else {
    mp ? CENOTE_W8(float, true) : CENOTE_W8(float, false);
  }
#undef CENOTE_W8
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
          __m512 lo, hi;
          w4_unpack(q4 + n * (K / 2) + g * 16, lo, hi);
          store16(_mm512_add_ps(_mm512_mul_ps(lo, dv), mv), row + g * 32);
          store16(_mm512_add_ps(_mm512_mul_ps(hi, dv), mv), row + g * 32 + 16);
        } else {
          const int8_t* qg = q8 + n * K + g * group;
          for (int64_t i = 0; i < group; i += 16) {
            const __m512 w = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + i))));
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

// fused_ops.cpp
void add_rms_norm_(at::Tensor x, const c10::optional<at::Tensor>& residual,
                   const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t width);
// decode_stack.cpp
void bind_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "x @ dequant(w).T for few rows (fused)");
  m.def("quant_dequantize", &quant_dequantize, "dense weight of a quantized one");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up projection");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k heads, in place");
  bind_decode_stack(m);
}
