// Fused elementwise steps of a decoder layer, each one pass over its rows instead of five to
// eight torch ops (a decode step of a small model is bound by per-op overhead, not by FLOPs).
// Every op reproduces torch's rounding in the tensor's dtype step by step (bf16 products are
// rounded where torch rounds them), so results match the unfused torch code to float32
// reassociation of the one sum (RMSNorm's mean of squares).
//
//   add_rms_norm_(x, residual, weight, eps): residual += x (when given), then
//       x = weight * (residual * rsqrt(mean(residual^2) + eps)).to(dtype)   [in place]
//   silu_and_mul(gate_up [T, 2I]) -> silu(gate) * up [T, I]
//   rotary_(qk [T, H * D], cos [T, D], sin [T, D]): x * cos + rotate_half(x) * sin, in place
//   argmax_rows(x [R, V] fp32) -> [R] int64: torch.argmax(x, -1) (the sampler's choice)
//   apply_token_bitmask_(logits [R, V] fp32, rows [k] int64, words [k, W] int32) -> [k] bool:
//       -inf on logits[rows[i], t] where bit t % 32 of words[i, t / 32] is 0 (and t >= 32 W),
//       in place; true where the row kept a finite value (structured outputs' masks)
//   layer_norm_(x [T, D] bf16, weight [D], bias [D], eps): torch's LayerNorm, in place
//   add_layer_norm_(x, residual?, weight, bias, eps): x = LayerNorm(x + residual), the sum in fp32

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "include/bf16_bits.h"
#include "include/ops.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Element access through the storage bits (bf16_bits.h), so that every loop below vectorizes.
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return cenote_bf16::bf16_to_float(v); }

inline void store(float& out, float v) { out = v; }
inline void store(uint16_t& out, float v) { out = cenote_bf16::float_to_bf16(v); }

// ``v`` rounded to the storage dtype S (torch rounding an intermediate product).
template <typename S>
inline float round_to(float v) {
  S s;
  store(s, v);
  return to_float(s);
}

template <typename S>
S* storage(at::Tensor& t) {
  return reinterpret_cast<S*>(t.data_ptr());
}
template <typename S>
const S* storage(const at::Tensor& t) {
  return reinterpret_cast<const S*>(t.data_ptr());
}

// Rows are normalized in blocks of kNormBlock: the sum of squares of each row is added in
// column order (as ever, so results do not move), and the rows of a full block interleave their
// sums so that the adds of one row wait on each other, not the whole block. Scalar on purpose:
// GCC would otherwise vectorize the interleaved sums with a gather per column.
constexpr int64_t kNormBlock = 8;

__attribute__((optimize("no-tree-vectorize", "no-tree-slp-vectorize"))) void sum_in_order(
    const float* squares, int64_t n, int64_t dim, float* sums) {  // squares: [n, dim]
  if (n == kNormBlock) {
    float s[kNormBlock] = {};
    for (int64_t j = 0; j < dim; ++j)
      for (int64_t k = 0; k < kNormBlock; ++k) s[k] += squares[k * dim + j];
    std::copy(s, s + kNormBlock, sums);
    return;
  }
  for (int64_t k = 0; k < n; ++k) {
    float s = 0.f;
    for (int64_t j = 0; j < dim; ++j) s += squares[k * dim + j];
    sums[k] = s;
  }
}

template <typename S>
void add_rms_norm_impl(at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                       double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  S* xp = storage<S>(x);
  S* rp = residual ? storage<S>(*residual) : nullptr;
  const S* wp = storage<S>(weight);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> squares;  // [kNormBlock, dim]
    squares.resize(kNormBlock * dim);
    for (int64_t b0 = r0; b0 < r1; b0 += kNormBlock) {
      const int64_t n = std::min(kNormBlock, r1 - b0);
      // 1) residual = residual + x (rounded to the dtype, as torch's add); the squares
      for (int64_t k = 0; k < n; ++k) {
        S* xr = xp + (b0 + k) * dim;
        float* sq = squares.data() + k * dim;
        if (rp != nullptr) {
          S* rr = rp + (b0 + k) * dim;
#pragma omp simd
          for (int64_t j = 0; j < dim; ++j) {
            store(rr[j], to_float(rr[j]) + to_float(xr[j]));
            const float v = to_float(rr[j]);
            sq[j] = v * v;
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < dim; ++j) {
            const float v = to_float(xr[j]);
            sq[j] = v * v;
          }
        }
      }
      // 2) each row's sum in column order
      float sums[kNormBlock];
      sum_in_order(squares.data(), n, dim, sums);
      // 3) x = weight * (src * rsqrt(mean + eps)).to(dtype)
      for (int64_t k = 0; k < n; ++k) {
        S* xr = xp + (b0 + k) * dim;
        const S* src = rp != nullptr ? rp + (b0 + k) * dim : xr;
        const float inv = 1.f / std::sqrt(sums[k] / static_cast<float>(dim) + e);
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) {
          const float normed = round_to<S>(to_float(src[j]) * inv);
          store(xr[j], to_float(wp[j]) * normed);
        }
      }
    }
  });
}

template <typename S>
void rotary_impl(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t width) {
  const int64_t rows = qk.size(0), dim = cos.size(1), half = dim / 2;
  const int64_t heads = width / dim, stride = qk.stride(0);
  S* xp = storage<S>(qk);
  const S* cp = storage<S>(cos);
  const S* sp = storage<S>(sin);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* c = cp + r * dim;
      const S* s = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        S* x = xp + r * stride + h * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_float(x[j]), b = to_float(x[j + half]);
          // torch: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype
          const float lo =
              round_to<S>(a * to_float(c[j])) + round_to<S>(-b * to_float(s[j]));
          const float hi = round_to<S>(b * to_float(c[j + half])) +
                           round_to<S>(a * to_float(s[j + half]));
          store(x[j], lo);
          store(x[j + half], hi);
        }
      }
    }
  });
}

// The index of the first maximum of x[0 .. n), as torch.argmax: a NaN counts as the maximum, so
// the first NaN wins. Per AVX-512 lane the first strictly greater value is kept, then the
// lanes holding the maximum give the smallest index; NaNs send the row to the scalar scan.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t j = 0, best = 0;
  float top = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = _mm512_loadu_ps(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i vindex = index;
    __mmask16 nan = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= n; j += 16) {
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + j);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vbest = _mm512_mask_mov_ps(vbest, greater, v);
      vindex = _mm512_mask_mov_epi32(vindex, greater, index);
    }
    if (nan == 0) {
      top = _mm512_reduce_max_ps(vbest);
      const __mmask16 at = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(top), _CMP_EQ_OQ);
      best = _mm512_mask_reduce_min_epi32(at, vindex);
    } else {
      j = 0;  // a NaN among the first j: the scalar scan finds the first one
    }
  }
#endif
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > top) {
      top = x[j];
      best = j;
    }
  }
  return best;
}

#if defined(__AVX512F__)
// The first min(left, 16) lanes of a 16-lane register.
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
#endif

// LayerNorm of each bf16 row in place, as torch computes it: mean and rstd = 1 / sqrt(var + eps)
// (biased variance) in fp32, y = (x * rstd - mean * rstd) * weight + bias in fp32, rounded
// once. One pass for the moments: sums of d = x - x[0] and of d^2 in four chains each (the
// shift by a value of the row keeps sum(d^2) / n - mean(d)^2 from cancelling).
// With ``res`` (rows of stride ``res_stride``), the row normalized is x + res, added in fp32.
void layer_norm_bf16_rows(uint16_t* x, int64_t rows, int64_t dim, int64_t stride,
                          const uint16_t* res, int64_t res_stride, const float* w,
                          const float* b, float eps) {
  const float inv_dim = 1.0f / static_cast<float>(dim);
  at::parallel_for(0, rows, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* xr = x + r * stride;
      const uint16_t* rr = res ? res + r * res_stride : nullptr;
      const auto at = [&](int64_t j) {
        const float v = cenote_bf16::bf16_to_float(xr[j]);
        return rr ? v + cenote_bf16::bf16_to_float(rr[j]) : v;
      };
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const auto load = [&](__mmask16 in, int64_t j) {
        const auto widen = [&](const uint16_t* p) {
          return _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, p + j)), 16));
        };
        return rr ? _mm512_add_ps(widen(xr), widen(rr)) : widen(xr);
      };
#endif
      const float first = at(0);
      float sum = 0.0f, squares = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const __m512 k = _mm512_set1_ps(first);
      __m512 s1[4], s2[4];
      for (int i = 0; i < 4; ++i) s1[i] = s2[i] = _mm512_setzero_ps();
      for (int64_t j = 0, i = 0; j < dim; j += 16, i = (i + 1) & 3) {
        const __mmask16 in = lanes(dim - j);
        const __m512 d = _mm512_maskz_sub_ps(in, load(in, j), k);
        s1[i] = _mm512_add_ps(s1[i], d);
        s2[i] = _mm512_fmadd_ps(d, d, s2[i]);
      }
      sum = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(s1[0], s1[1]), _mm512_add_ps(s1[2], s1[3])));
      squares = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(s2[0], s2[1]), _mm512_add_ps(s2[2], s2[3])));
#else
#pragma omp simd reduction(+ : sum, squares)
      for (int64_t j = 0; j < dim; ++j) {
        const float d = at(j) - first;
        sum += d;
        squares += d * d;
      }
#endif
      const float shifted = sum * inv_dim, mean = first + shifted;
      const float var = std::max(squares * inv_dim - shifted * shifted, 0.0f);
      const float rstd = 1.0f / std::sqrt(var + eps), shift = -rstd * mean;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const __m512 sc = _mm512_set1_ps(rstd), sh = _mm512_set1_ps(shift);
      for (int64_t j = 0; j < dim; j += 16) {
        const __mmask16 in = lanes(dim - j);
        const __m512 normed = _mm512_add_ps(_mm512_mul_ps(load(in, j), sc), sh);
        const __m512 y = _mm512_add_ps(_mm512_mul_ps(normed, _mm512_maskz_loadu_ps(in, w + j)),
                                       _mm512_maskz_loadu_ps(in, b + j));
        _mm256_mask_storeu_epi16(xr + j, in, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
      }
#else
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) {
        xr[j] = cenote_bf16::float_to_bf16((at(j) * rstd + shift) * w[j] + b[j]);
      }
#endif
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-d with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be fp32 or bf16");
}

}  // namespace

void add_rms_norm_(at::Tensor x, const c10::optional<at::Tensor>& residual,
                   const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must be [dim] in x's dtype");
  at::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type() &&
                    res.is_contiguous(),
                "residual must match x");
  }
  at::Tensor* rp = residual.has_value() ? &res : nullptr;
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, rp, weight, eps);
  } else {
    add_rms_norm_impl<uint16_t>(x, rp, weight, eps);
  }
}

// torch's own vectorized silu and mul on the two halves: the same two roundings as
// ``F.silu(gate) * up``, bit for bit, and faster than a scalar exp per element at every row
// count (measured: 1 row 8.0 -> 4.5 us, 16 rows 75 -> 20 us, bf16 x 1536).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2 * intermediate]");
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor out = at::silu(gate_up.narrow(1, 0, inter));
  return out.mul_(gate_up.narrow(1, inter, inter));
}

// Rotates the first ``width`` columns of each row of ``qk`` (q and k heads side by side).
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t width) {
  check_rows(qk, "qk");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == qk.size(0) && cos.scalar_type() == qk.scalar_type() &&
                  sin.scalar_type() == qk.scalar_type(),
              "cos and sin must be contiguous [T, head_dim] in qk's dtype");
  TORCH_CHECK(cos.size(1) % 2 == 0 && width % cos.size(1) == 0 && width <= qk.size(1),
              "width must be a multiple of head_dim within the row");
  if (qk.scalar_type() == at::kFloat) {
    rotary_impl<float>(qk, cos, sin, width);
  } else {
    rotary_impl<uint16_t>(qk, cos, sin, width);
  }
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be fp32 [rows, n > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

// One 32-token block of apply_token_bitmask_ whose word is neither 0 nor all ones: -inf where
// its bit is 0; whether an allowed logit is finite (v - v == 0 exactly for finite v).
static inline bool mask_block(float* block, uint32_t word) {
#if defined(__AVX2__)
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 finite = _mm256_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(word >> (8 * g))),
                                          lane_bits);
    const __m256 allowed = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bits));
    const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(block + 8 * g), allowed);
    _mm256_storeu_ps(block + 8 * g, v);
    finite = _mm256_or_ps(
        finite, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ));
  }
  return _mm256_movemask_ps(finite) != 0;
#else
  bool any = false;
  for (int j = 0; j < 32; ++j) {
    const bool allowed = (word >> j) & 1u;
    if (!allowed) block[j] = -std::numeric_limits<float>::infinity();
    any |= allowed && std::isfinite(block[j]);
  }
  return any;
#endif
}

// One row of apply_token_bitmask_: whether it kept a finite logit.
static bool mask_row(float* row, int64_t vocab, const uint32_t* words, int64_t num_words) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t num_full = std::min(vocab / 32, num_words);
  bool kept = false;
  for (int64_t b = 0; b < num_full; ++b) {
    const uint32_t word = words[b];
    float* block = row + 32 * b;
    if (word == 0) {  // the common case inside a constrained step: a block refused whole
      std::fill(block, block + 32, neg_inf);
    } else if (word == 0xFFFFFFFFu && kept) {  // a block allowed whole, once one is kept
      continue;
    } else {
      kept |= mask_block(block, word);
    }
  }
  for (int64_t t = num_full * 32; t < vocab; ++t) {  // a last partial word, then unknown ids
    const int64_t b = t / 32;
    const bool allowed = b < num_words && ((words[b] >> (t % 32)) & 1u);
    if (!allowed) row[t] = neg_inf;
    kept |= allowed && std::isfinite(row[t]);
  }
  return kept;
}

at::Tensor apply_token_bitmask_(at::Tensor logits, const at::Tensor& rows, const at::Tensor& words) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be fp32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be contiguous int64 [k]");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous() &&
                  words.size(0) == rows.size(0),
              "words must be contiguous int32 [", rows.size(0), ", W]");
  const int64_t k = rows.size(0), vocab = logits.size(1), num_words = words.size(1);
  const int64_t stride = logits.stride(0), num_rows = logits.size(0);
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < num_rows, "row ", rp[i], " outside [0, ", num_rows, ")");
  }
  at::Tensor kept = at::empty({k}, rows.options().dtype(at::kBool));
  bool* kp = kept.mutable_data_ptr<bool>();
  float* lp = logits.mutable_data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint32_t*>(words.const_data_ptr<int32_t>());
  at::parallel_for(0, k, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      kp[i] = mask_row(lp + rp[i] * stride, vocab, wp + i * num_words, num_words);
    }
  });
  return kept;
}

// x = LayerNorm(x) * weight + bias in place, bf16 rows (weight, bias: bf16 [dim], as the
// module holds them; widened to fp32 once per call).
void add_layer_norm_(at::Tensor x, const c10::optional<at::Tensor>& residual,
                     const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16");
  const int64_t dim = x.size(1);
  for (const at::Tensor* t : {&weight, &bias}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == dim && t->scalar_type() == at::kBFloat16 &&
                    t->is_contiguous(),
                "weight and bias must be bf16 [", dim, "]");
  }
  std::vector<float> w(dim), b(dim);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  const auto* bp = reinterpret_cast<const uint16_t*>(bias.const_data_ptr());
  for (int64_t j = 0; j < dim; ++j) {
    w[j] = cenote_bf16::bf16_to_float(wp[j]);
    b[j] = cenote_bf16::bf16_to_float(bp[j]);
  }
  const uint16_t* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == x.size(0) &&
                    residual->size(1) == dim,
                "residual must be bf16 [", x.size(0), ", ", dim, "], got ", residual->sizes());
    res = reinterpret_cast<const uint16_t*>(residual->const_data_ptr());
    res_stride = residual->stride(0);
  }
  layer_norm_bf16_rows(reinterpret_cast<uint16_t*>(x.data_ptr()), x.size(0), dim, x.stride(0),
                       res, res_stride, w.data(), b.data(), static_cast<float>(eps));
}

void layer_norm_(at::Tensor x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  add_layer_norm_(x, c10::nullopt, weight, bias, eps);
}
