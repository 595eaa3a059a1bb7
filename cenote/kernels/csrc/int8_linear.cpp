// w8a8 linear layers: int8 weights (symmetric, one scale per output channel) times 8-bit
// activations (asymmetric, one scale and zero point per row, computed from the rows at each
// call), accumulated in int32 on oneDNN's brgemm micro-kernels (AMX-INT8, AVX512-VNNI), then one
// fp32 epilogue per tile of the product while it is in cache: dequantize, bias, then GELU (erf)
// or a residual add, rounded once to bf16. Where FLOPs bound the matmuls (embeddings, prefill)
// an int8 product has twice the peak of a bf16 one.
//
//   int8_pack(w [N, K]) -> (packed int8, scales fp32 [N], column sums int32 [N])
//   int8_linear(x [M, K] bf16, packed, scales, column sums, bias?, residual?, gelu) -> [M, N]
//   int8_supported() -> whether the micro-kernels give the right product here (checked once)
//
// The micro-kernels multiply unsigned by signed bytes (VNNI): a row is stored as
// u = round(x / scale) + zero_point in [0, 255] over [min(x, 0), max(x, 0)], so the product
// carries zero_point * sum_k w[n][k], which the epilogue removes with the column sums. Asymmetric
// rows keep a bit that symmetric ones lose on skewed rows (GELU outputs): all-MiniLM-L6-v2's
// embeddings, min cosine vs fp32 over the parity texts, 0.984 symmetric -> 0.992 asymmetric
// (fake-quantized in fp32). Weights are packed in blocks of 64 output channels, each
// [K4 / 4][64][4] (VNNI quads along K, K padded to K4 = a multiple of 4 with zero weights).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "include/bf16_bits.h"
#include "include/ops.h"
#include "include/parallel.h"

namespace {

namespace cpublas = at::native::cpublas;
using cenote_bf16::bf16_to_float;
using cenote_bf16::float_to_bf16;

constexpr int64_t kBlockN = 64;  // output channels per packed block (oneDNN's widest B)
constexpr int64_t kRows = 64;    // rows per task of a large batch
constexpr int64_t kRowGrain = 16;  // row counts round up to it (a bounded set of kernel shapes)

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// erf(x) to 3e-7 absolute (Abramowitz & Stegun 7.1.28): a polynomial, a 16th power and a
// division, so the epilogue's loop vectorizes; exact GELU's output is rounded to bf16 (2^-9).
inline float erf_as(float x) {
  const float a = std::fabs(x);
  float p = 0.0000430638f;
  p = p * a + 0.0002765672f;
  p = p * a + 0.0001520143f;
  p = p * a + 0.0092705272f;
  p = p * a + 0.0422820123f;
  p = p * a + 0.0705230784f;
  p = p * a + 1.0f;
  p = p * p;  // ^2
  p = p * p;  // ^4
  p = p * p;  // ^8
  p = p * p;  // ^16 (inf for large |x|: erf = 1)
  const float e = 1.0f - 1.0f / p;
  return x < 0.0f ? -e : e;
}

// A row of x (bf16 bits, K values) as unsigned bytes (K4 of them; the padding multiplies zero
// weights); returns its scale and sets its zero point.
inline float quantize_row(const uint16_t* x, int64_t K, int64_t K4, uint8_t* q, int32_t* zero) {
  float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t k = 0; k < K; ++k) {
    const float v = bf16_to_float(x[k]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const float range = hi - lo;
  const float scale = range > 0.0f ? range / 255.0f : 1.0f;
  const float inverse = range > 0.0f ? 255.0f / range : 0.0f;
  const int32_t zp = static_cast<int32_t>(std::nearbyint(-lo * inverse));
  const float low = static_cast<float>(-zp), high = static_cast<float>(255 - zp);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float u = std::min(std::max(std::nearbyint(bf16_to_float(x[k]) * inverse), low), high);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(u) + zp);
  }
  for (int64_t k = K; k < K4; ++k) q[k] = 0;
  *zero = zp;
  return scale;
}

struct Problem {
  int64_t M, N, K, K4;
  const uint16_t* x;
  int64_t x_stride;
  const int8_t* w;  // packed blocks
  const float* w_scales;
  const int32_t* col_sums;
  const float* bias;         // [N] (zeros without one)
  const uint16_t* residual;  // or null
  int64_t residual_stride;
  bool gelu;
  uint16_t* out;
  int64_t out_stride;
};

// Rows [r0, r0 + m) of the output, columns of blocks [b0, b1): q holds those rows quantized
// (kRowGrain-padded, lda K4), scales and zeros their scales and zero points. Each epilogue is its
// own branch-free loop, so that it vectorizes.
void tile_rows(const Problem& p, const uint8_t* q, const float* scales, const int32_t* zeros,
               int64_t r0, int64_t m, int64_t b0, int64_t b1, std::vector<int32_t>& acc) {
  const int64_t mp = round_up(m, kRowGrain);
  acc.resize(mp * kBlockN);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kBlockN, nb = std::min(kBlockN, p.N - n0);
    cpublas::brgemm(mp, kBlockN, p.K4, p.K4, kBlockN, kBlockN, false, q,
                    p.w + b * p.K4 * kBlockN, acc.data(), true);
    const float* ws = p.w_scales + n0;
    const float* bias = p.bias + n0;
    const int32_t* c = p.col_sums + n0;
    for (int64_t r = 0; r < m; ++r) {
      const int32_t* a = &acc[r * kBlockN];
      uint16_t* o = p.out + (r0 + r) * p.out_stride + n0;
      const float s = scales[r];
      const int32_t z = zeros[r];
      if (p.gelu) {
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) {
          const float y = static_cast<float>(a[j] - z * c[j]) * (s * ws[j]) + bias[j];
          o[j] = float_to_bf16(0.5f * y * (1.0f + erf_as(y * 0.70710678118654752f)));
        }
      } else if (p.residual) {
        const uint16_t* res = p.residual + (r0 + r) * p.residual_stride + n0;
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) {
          const float y = static_cast<float>(a[j] - z * c[j]) * (s * ws[j]) + bias[j];
          o[j] = float_to_bf16(y + bf16_to_float(res[j]));
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < nb; ++j) {
          o[j] = float_to_bf16(static_cast<float>(a[j] - z * c[j]) * (s * ws[j]) + bias[j]);
        }
      }
    }
  }
}

bool check_product() {
  constexpr int64_t M = 16, N = kBlockN, K = 8;  // a = 130 + (k + i) % 3; w = (k + n) % 5 - 2
  std::vector<uint8_t> a(M * K);
  std::vector<int8_t> b(K * N);
  std::vector<int32_t> c(M * N, -1);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k) a[i * K + k] = static_cast<uint8_t>(130 + (k + i) % 3);
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) b[(k / 4) * N * 4 + n * 4 + k % 4] = (k + n) % 5 - 2;
  }
  try {
    cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
    cpublas::brgemm_release(true);
  } catch (const c10::Error&) {
    return false;
  }
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t n = 0; n < N; ++n) {
      int32_t expected = 0;
      for (int64_t k = 0; k < K; ++k) expected += (130 + (k + i) % 3) * ((k + n) % 5 - 2);
      if (c[i * N + n] != expected) return false;
    }
  }
  return true;
}

}  // namespace

bool int8_supported() {
  static const bool ok = check_product();
  return ok;
}

std::vector<at::Tensor> int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const int64_t N = w.size(0), K = w.size(1), K4 = round_up(K, 4);
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  at::Tensor packed = at::zeros({blocks, K4 / 4, kBlockN, 4}, w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({N}, w.options());
  at::Tensor col_sums = at::empty({N}, w.options().dtype(at::kInt));
  const float* wd = w.const_data_ptr<float>();
  int8_t* pd = packed.mutable_data_ptr<int8_t>();
  float* sd = scales.mutable_data_ptr<float>();
  int32_t* cd = col_sums.mutable_data_ptr<int32_t>();
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      const float* row = wd + n * K;
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
      sd[n] = scale;
      int32_t sum = 0;
      int8_t* block = pd + (n / kBlockN) * K4 * kBlockN;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(row[k] / scale));
        const int8_t q = static_cast<int8_t>(std::clamp(v, -127, 127));
        block[(k / 4) * kBlockN * 4 + (n % kBlockN) * 4 + k % 4] = q;
        sum += q;
      }
      cd[n] = sum;
    }
  });
  return {packed, scales, col_sums};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& col_sums, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be bf16 rows [M, K] with contiguous columns");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kBlockN && packed.size(3) == 4,
              "packed must come from int8_pack");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), K4 = packed.size(1) * 4;
  TORCH_CHECK(round_up(K, 4) == K4, "x has ", K, " columns, the weight ", K4, " (padded)");
  TORCH_CHECK(packed.size(0) == (N + kBlockN - 1) / kBlockN && col_sums.size(0) == N &&
                  scales.scalar_type() == at::kFloat && col_sums.scalar_type() == at::kInt,
              "scales / column sums do not match the packed weight");
  TORCH_CHECK(!(gelu && residual.has_value()), "one epilogue: gelu or a residual add");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == N,
                "bias must be N contiguous bf16 values");
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->dim() == 2 &&
                    residual->size(0) == M && residual->size(1) == N && residual->stride(1) == 1,
                "residual must be bf16 [M, N] with contiguous columns");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor bias_f =
      bias.has_value() ? bias->to(at::kFloat) : at::zeros({N}, scales.options());
  const auto bits = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.const_data_ptr<c10::BFloat16>());
  };
  Problem p{M,
            N,
            K,
            K4,
            bits(x),
            x.stride(0),
            packed.const_data_ptr<int8_t>(),
            scales.const_data_ptr<float>(),
            col_sums.const_data_ptr<int32_t>(),
            bias_f.const_data_ptr<float>(),
            residual.has_value() ? bits(*residual) : nullptr,
            residual.has_value() ? residual->stride(0) : 0,
            gelu,
            reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>()),
            out.stride(0)};
  const int64_t blocks = packed.size(0), threads = at::get_num_threads();
  const int64_t row_tasks = (M + kRows - 1) / kRows;
  if (row_tasks >= 2 * threads) {
    // many rows: a task quantizes its rows (they stay in cache) and computes all columns
    cenote::share_tasks(row_tasks, [&](auto& next) {
      std::vector<uint8_t> q(kRows * K4, 0);
      std::vector<float> s(kRows);
      std::vector<int32_t> z(kRows);
      std::vector<int32_t> acc;
      for (int64_t t = next(); t >= 0; t = next()) {
        const int64_t r0 = t * kRows, m = std::min(kRows, M - r0);
        for (int64_t r = 0; r < m; ++r) {
          s[r] = quantize_row(p.x + (r0 + r) * p.x_stride, K, K4, &q[r * K4], &z[r]);
        }
        tile_rows(p, q.data(), s.data(), z.data(), r0, m, 0, blocks, acc);
      }
      cpublas::brgemm_release(true);
    });
    return out;
  }
  // few rows: quantize them once, then share the column blocks
  const int64_t mp = round_up(M, kRowGrain);
  std::vector<uint8_t> q(mp * K4, 0);
  std::vector<float> s(M);
  std::vector<int32_t> z(M);
  for (int64_t r = 0; r < M; ++r) {
    s[r] = quantize_row(p.x + r * p.x_stride, K, K4, &q[r * K4], &z[r]);
  }
  const int64_t row_chunks = (M + kRows - 1) / kRows;
  cenote::share_tasks(row_chunks * blocks, [&](auto& next) {
    std::vector<int32_t> acc;
    for (int64_t t = next(); t >= 0; t = next()) {
      const int64_t r0 = (t / blocks) * kRows, b = t % blocks, m = std::min(kRows, M - r0);
      tile_rows(p, &q[r0 * K4], &s[r0], &z[r0], r0, m, b, b + 1, acc);
    }
    cpublas::brgemm_release(true);
  });
  return out;
}
