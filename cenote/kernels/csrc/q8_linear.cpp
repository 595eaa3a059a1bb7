// Quantized weights times 8-bit activations, for decode steps of 1-8 rows (issue 33): each
// activation row is quantized once per call to int8 in blocks of 32, one fp32 scale per block
// (GGUF's Q8_0), and meets the 4-bit or 8-bit weight groups (quant_linear.cpp's layouts, groups
// of 32) in integer dot products, each group's int32 sum scaled to fp32 and summed in fp32:
//   sum_j x_j (d q_j + m) ~= d dx sum_j q_j xq_j + m dx sum_j xq_j      (x_j ~= dx xq_j).
// The weights are never widened to fp32 (the fp32 row kernel spends 12 vector operations a
// 4-bit group on that); a group costs one u8 x s8 multiply-add chain per row:
//   AVX2: vpmaddubsw (u8 x s8 -> pairs of int16) then vpmaddwd by ones (-> int32 of 4);
//   AVX512-VNNI: one vpdpbusd (u8 x s8, 4 products a lane into int32).
// 8-bit weights are signed: their magnitude is the unsigned operand and their sign moves onto
// the activation (vpsignb), as llama.cpp's Q8_0 dot does. No int16 sum saturates: a pair is at
// most 2 * 128 * 127 = 32512. Other builds (no AVX2) run the same arithmetic in scalar loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>

#include "include/bf16_bits.h"
#include "include/ops.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ8MaxRows = 8;

inline float to_float(float v) { return v; }
#if defined(__F16C__)
inline float to_float(c10::Half v) { return _cvtsh_ss(v.x); }  // c10's own is bit twiddling
#else
inline float to_float(c10::Half v) { return static_cast<float>(v); }
#endif

// One activation row quantized: xq[K] int8, dx[groups] its block scales, xs[groups] =
// dx * sum(xq) of each block (the min term's factor).
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;
};

// Round half away from zero, as GGUF's Q8_0 quantizer (roundf), by adding +-0.5 in fp32 and
// truncating (std::lround's call measured a tenth of a one-row step).
template <typename X>
QuantizedRows quantize_rows(const X* x, int64_t M, int64_t K) {
  const int64_t groups = K / kBlock;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * groups),
                  std::vector<float>(M * groups)};
  for (int64_t i = 0; i < M * groups; ++i) {
    float v[kBlock], amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      if constexpr (std::is_same_v<X, float>) {
        v[j] = x[i * kBlock + j];
      } else {
        v[j] = cenote_bf16::bf16_to_float(x[i * kBlock + j]);
      }
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float t = v[j] * inv;
      const int8_t q = static_cast<int8_t>(static_cast<int32_t>(t + (t < 0.f ? -0.5f : 0.5f)));
      r.xq[i * kBlock + j] = q;
      sum += q;
    }
    r.dx[i] = d;
    r.xs[i] = d * static_cast<float>(sum);
  }
  return r;
}

#if defined(__AVX2__)
// The int32 dot products of 32 unsigned bytes w and 32 signed bytes x, as 8 lanes of int32.
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Group g of a row's weights as 32 unsigned bytes in element order (8-bit: their magnitudes).
template <int BITS>
inline __m256i load_group(const uint8_t* q, int64_t g) {
  if constexpr (BITS == 4) {  // byte j: element j (low nibble), j + 16 (high)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                            _mm_and_si128(bytes, mask));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kBlock));
  }
}

// acc + (w . xq_g) * s, 8 fp32 lanes of partial sums (w: load_group's bytes of the same group).
template <int BITS>
inline __m256 add_group(__m256 acc, __m256i w, const int8_t* xg, float s) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
  if constexpr (BITS == 8) {  // |w| x (x with w's sign)
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w, x)), _mm256_set1_ps(s), acc);
}

// sum_g d_g dx_g (q_g . xq_g) for MB rows of xq (leading dimension K): one output row's groups,
// even and odd groups in two accumulator chains (one chain left the loop waiting on the fused
// multiply-add's latency).
template <typename S, int BITS, int MB>
inline void group_dots(const uint8_t* q, const S* scale, const int8_t* xq, const float* dx,
                       int64_t K, int64_t groups, float* out) {
  __m256 even[MB], odd[MB];
  for (int m = 0; m < MB; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const __m256i w0 = load_group<BITS>(q, g), w1 = load_group<BITS>(q, g + 1);
    const float d0 = to_float(scale[g]), d1 = to_float(scale[g + 1]);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xg = xq + m * K + g * kBlock;
      even[m] = add_group<BITS>(even[m], w0, xg, d0 * dx[m * groups + g]);
      odd[m] = add_group<BITS>(odd[m], w1, xg + kBlock, d1 * dx[m * groups + g + 1]);
    }
  }
  if (g < groups) {
    const __m256i w0 = load_group<BITS>(q, g);
    const float d0 = to_float(scale[g]);
    for (int m = 0; m < MB; ++m)
      even[m] = add_group<BITS>(even[m], w0, xq + m * K + g * kBlock, d0 * dx[m * groups + g]);
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(even[m], odd[m]));
}
#else
template <typename S, int BITS, int MB>
inline void group_dots(const uint8_t* q, const S* scale, const int8_t* xq, const float* dx,
                       int64_t K, int64_t groups, float* out) {
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const float d = to_float(scale[g]);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xg = xq + m * K + g * kBlock;
      int32_t sum = 0;
      if constexpr (BITS == 4) {
        const uint8_t* qg = q + g * 16;
        for (int j = 0; j < 16; ++j) sum += (qg[j] & 0x0F) * xg[j] + (qg[j] >> 4) * xg[j + 16];
      } else {
        const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * kBlock;
        for (int j = 0; j < kBlock; ++j) sum += qg[j] * xg[j];
      }
      out[m] += static_cast<float>(sum) * (d * dx[m * groups + g]);
    }
  }
}
#endif

// out [M, N] (fp32, or bf16 bits rounded once) for MB rows at a time.
template <typename S, bool HAS_MIN, int BITS, typename O>
void q8_rows(const QuantizedRows& xr, int64_t M, int64_t K, const at::Tensor& q,
             const at::Tensor& scale, const at::Tensor* mn, O* out) {
  const int64_t N = q.size(0), groups = K / kBlock, row_bytes = K * BITS / 8;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const S* sp = scale.data_ptr<S>();
  const S* mp = HAS_MIN ? mn->data_ptr<S>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = qp + n * row_bytes;
      const S* sn = sp + n * groups;
      if (n + 4 < n1) {  // the row 4 ahead, streamed from memory once per step
        for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(qn + 4 * row_bytes + off, _MM_HINT_T0);
      }
      float sums[kQ8MaxRows];
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        group_dots<S, BITS, 4>(qn, sn, xr.xq.data() + m * K, xr.dx.data() + m * groups, K,
                               groups, sums + m);
      for (; m + 2 <= M; m += 2)
        group_dots<S, BITS, 2>(qn, sn, xr.xq.data() + m * K, xr.dx.data() + m * groups, K,
                               groups, sums + m);
      for (; m < M; ++m)
        group_dots<S, BITS, 1>(qn, sn, xr.xq.data() + m * K, xr.dx.data() + m * groups, K,
                               groups, sums + m);
      for (m = 0; m < M; ++m) {
        float total = sums[m];
        if constexpr (HAS_MIN) {
          const S* mnn = mp + n * groups;
          const float* xs = xr.xs.data() + m * groups;
          float t = 0.f;
          for (int64_t g = 0; g < groups; ++g) t += to_float(mnn[g]) * xs[g];
          total += t;
        }
        if constexpr (std::is_same_v<O, float>) {
          out[m * N + n] = total;
        } else {
          out[m * N + n] = cenote_bf16::float_to_bf16(total);
        }
      }
    }
  });
}

template <typename S, typename O>
void q8_layout(const QuantizedRows& xr, int64_t M, int64_t K, const at::Tensor& q,
               const at::Tensor& scale, const at::Tensor* mn, int64_t bits, O* out) {
  if (bits == 4) {
    mn ? q8_rows<S, true, 4, O>(xr, M, K, q, scale, mn, out)
       : q8_rows<S, false, 4, O>(xr, M, K, q, scale, mn, out);
  } else {
    mn ? q8_rows<S, true, 8, O>(xr, M, K, q, scale, mn, out)
       : q8_rows<S, false, 8, O>(xr, M, K, q, scale, mn, out);
  }
}

}  // namespace

// out [M, N] = x [M, K] @ dequant(w).T in x's dtype (fp32 or bf16) with x quantized to 8 bits
// per block of 32 (see the top of the file); M <= 8, weights in groups of 32.
at::Tensor quant_matmul_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& mn, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous fp32 or bf16 [M, K] tensor");
  TORCH_CHECK(x.size(0) <= kQ8MaxRows, "quant_matmul_q8 takes at most ", kQ8MaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == kBlock, "quant_matmul_q8 multiplies groups of 32, got ", group);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "K=", K, " is not a multiple of 32");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(1) == (bits == 4 ? K / 2 : K) &&
                  q.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "qdata must be a contiguous ", bits == 4 ? "uint8 [N, K / 2]" : "int8 [N, K]",
              " tensor for K=", K);
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.size(0) == q.size(0) &&
                  scale.size(1) == K / kBlock &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scales must be a contiguous fp32 or fp16 [N, K / 32] tensor");
  if (mn.has_value()) {
    TORCH_CHECK(mn->sizes() == scale.sizes() && mn->scalar_type() == scale.scalar_type() &&
                    mn->is_contiguous(),
                "mins must match the scales' shape and dtype");
  }
  at::Tensor out = at::empty({M, q.size(0)}, x.options());
  if (M == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const QuantizedRows xr =
      bf16 ? quantize_rows(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K)
           : quantize_rows(x.const_data_ptr<float>(), M, K);
  const at::Tensor* mp = mn.has_value() ? &*mn : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
  if (bf16) {
    auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
    half ? q8_layout<c10::Half>(xr, M, K, q, scale, mp, bits, op)
         : q8_layout<float>(xr, M, K, q, scale, mp, bits, op);
  } else {
    float* op = out.mutable_data_ptr<float>();
    half ? q8_layout<c10::Half>(xr, M, K, q, scale, mp, bits, op)
         : q8_layout<float>(xr, M, K, q, scale, mp, bits, op);
  }
  return out;
}
