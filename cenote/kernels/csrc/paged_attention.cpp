// Attention kernels for CPU, built at first use by torch.utils.cpp_extension with
// -O3 -march=native (see attention_kernels.py). One source serves AVX-512, AVX2 and other CPUs:
// paged attention's inner loops are written once against a vector type for AVX-512 and AVX2
// (head sizes a multiple of 32 / 16), with plain loops for the auto-vectorizer otherwise.
//
// paged_attention: short queries over a paged KV cache read in place (no gather of the blocks).
//   Query row r attends to the keys at positions [key_starts[r], key_ends[r]) of its block
//   table row: position p lives at slot p % block_size of block block_tables[r][p / block_size].
//   Scores are fp32 (dot products of fp32-converted q and k), softmax in fp32, the weighted sum
//   of values accumulated in fp32 and rounded once to the query's dtype.
// varlen_attention (encoder batches) is in varlen_attention.cpp; the scalar helpers both use
// are in attention_common.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "include/attention_common.h"
#include "include/ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using cenote_attention::exp_nonpositive;
using cenote_attention::row_max;
using cenote_attention::store;
using cenote_attention::to_float;

struct Shapes {
  int64_t rows, heads, dim, kv_heads, num_blocks, block_size, group;
};

// The positions [start, end) of one block table row, a block's run of consecutive slots at a
// time: visit(rows, n, p) for the n rows of `base` (dim elements each) at positions p, p + 1, ...
template <typename T, typename F>
inline void for_each_run(const T* base, const int64_t* table, int64_t start, int64_t end,
                         const Shapes& s, F&& visit) {
  const int64_t BS = s.block_size;
  for (int64_t p = start; p < end;) {
    const int64_t offset = p % BS, n = std::min(BS - offset, end - p);
    visit(base + (table[p / BS] * BS + offset) * s.dim, n, p);
    p += n;
  }
}

// Portable passes (any head size, any CPU), the loops left to the auto-vectorizer.
// scores[g][p - start] = query[g] . key_p for the G query heads.
template <typename T>
void scores_portable(const float* query, const T* keys, const int64_t* table, int64_t start,
                     int64_t end, const Shapes& s, float* scores) {
  const int64_t G = s.group, D = s.dim, BS = s.block_size, L = end - start;
  for (int64_t p = start; p < end;) {
    const int64_t offset = p % BS, n = std::min(BS - offset, end - p);
    const T* k = keys + (table[p / BS] * BS + offset) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = query + g * D;
      float* sg = scores + g * L + (p - start);
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(k[j * D + d]);
        sg[j] = dot;
      }
    }
    p += n;
  }
}

// acc[g] = sum_p weights[g][p - start] * value_p, in key order.
template <typename T>
void values_portable(const float* weights, const T* values, const int64_t* table, int64_t start,
                     int64_t end, const Shapes& s, float* acc) {
  const int64_t G = s.group, D = s.dim, BS = s.block_size, L = end - start;
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t p = start; p < end;) {
    const int64_t offset = p % BS, n = std::min(BS - offset, end - p);
    const T* v = values + (table[p / BS] * BS + offset) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* wg = weights + g * L + (p - start);
      float* ag = acc + g * D;
      for (int64_t j = 0; j < n; ++j) {
        const float w = wg[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += w * to_float(v[j * D + d]);
      }
    }
    p += n;
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define CENOTE_VEC 1
// Vec: the vector ISA's register of kLanes fp32 values and the operations the SIMD passes below
// are written against, once for both ISAs. Rows are read 2 * kLanes elements (a pair of
// registers) at a time: fp32 in order, bf16 as its even and its odd elements (a bf16 is the high
// half of an fp32: the low element shifted up, the high one masked, no shuffles); the query and
// the weighted sums are kept in that order.
// The operations both ISAs spell alike but for the intrinsics' prefix P (_mm512 / _mm256):
// REG holds LANES fp32 values, INT the same BITS as integers.
#define CENOTE_VEC_OPS(P, REG, INT, BITS, LANES)                                               \
  using R = REG;                                                                               \
  static constexpr int64_t kLanes = LANES;                                                     \
  static R zero() { return P##_setzero_ps(); }                                                 \
  static R set1(float v) { return P##_set1_ps(v); }                                            \
  static R load(const float* p) { return P##_loadu_ps(p); }                                    \
  static void put(float* p, R v) { P##_storeu_ps(p, v); }                                      \
  static R add(R a, R b) { return P##_add_ps(a, b); }                                          \
  static R mul(R a, R b) { return P##_mul_ps(a, b); }                                          \
  static void load2(const float* p, R& a, R& b) {                                              \
    a = load(p);                                                                               \
    b = load(p + kLanes);                                                                      \
  }                                                                                            \
  static void load2(const c10::BFloat16* p, R& a, R& b) {                                      \
    const INT raw = P##_loadu_si##BITS(reinterpret_cast<const INT*>(p));                       \
    a = P##_castsi##BITS##_ps(P##_slli_epi32(raw, 16));                                        \
    b = P##_castsi##BITS##_ps(P##_and_si##BITS(raw, P##_set1_epi32(int32_t(0xFFFF0000))));    \
  }                                                                                            \
  /* load2's inverses; bf16 rounded to nearest even as c10::BFloat16(float) (NaN: 0x7FC0) */   \
  static void store2(float* p, R a, R b) {                                                     \
    put(p, a);                                                                                 \
    put(p + kLanes, b);                                                                        \
  }                                                                                            \
  static INT round_bf16(R x) {                                                                 \
    const INT bits = P##_castps_si##BITS(x);                                                   \
    const INT odd = P##_and_si##BITS(P##_srli_epi32(bits, 16), P##_set1_epi32(1));             \
    const INT rounded = P##_add_epi32(bits, P##_add_epi32(odd, P##_set1_epi32(0x7FFF)));       \
    return if_nan(x, P##_set1_epi32(0x7FC00000), rounded);                                     \
  }                                                                                            \
  static void store2(c10::BFloat16* p, R a, R b) {                                             \
    const INT low = P##_srli_epi32(round_bf16(a), 16);                                         \
    const INT high = P##_and_si##BITS(round_bf16(b), P##_set1_epi32(int32_t(0xFFFF0000)));     \
    P##_storeu_si##BITS(reinterpret_cast<INT*>(p), P##_or_si##BITS(low, high));                \
  }

#if defined(__AVX512F__)
struct Vec {
  static constexpr int kPairs = 2;  // register pairs of values per head summed at once
  // nan where x is NaN, else other
  static __m512i if_nan(__m512 x, __m512i nan, __m512i other) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), other, nan);
  }
  CENOTE_VEC_OPS(_mm512, __m512, __m512i, 512, 16)
  // out[j] = the sum of the lanes of dots[j] for j < n <= kLanes: a tree of shuffles and adds
  // that leaves key 4m + k in lane 4k + m, then one permute into order.
  static void sums(const float* dots, int64_t n, float* out) {
    R level1[8], level2[4];
    for (int i = 0; i < 8; ++i) {  // keys 2i, 2i + 1: 128-bit blocks (a, a, b, b)
      const R a = 2 * i < n ? load(dots + 2 * i * kLanes) : zero();
      const R b = 2 * i + 1 < n ? load(dots + (2 * i + 1) * kLanes) : zero();
      level1[i] = add(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 4; ++i) {  // keys 4i..4i + 3, one 128-bit block each
      const R a = level1[2 * i], b = level1[2 * i + 1];
      level2[i] = add(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    const R low = add(_mm512_unpacklo_ps(level2[0], level2[1]),
                      _mm512_unpackhi_ps(level2[0], level2[1]));
    const R high = add(_mm512_unpacklo_ps(level2[2], level2[3]),
                       _mm512_unpackhi_ps(level2[2], level2[3]));
    const __m512d l = _mm512_castps_pd(low), h = _mm512_castps_pd(high);
    const R all = add(_mm512_castpd_ps(_mm512_unpacklo_pd(l, h)),
                      _mm512_castpd_ps(_mm512_unpackhi_pd(l, h)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_mask_storeu_ps(out, __mmask16((1u << n) - 1), _mm512_permutexvar_ps(order, all));
  }
};
#else
struct Vec {
  static constexpr int kPairs = 1;
  static __m256i if_nan(__m256 x, __m256i nan, __m256i other) {
    const __m256 where = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(other), _mm256_castsi256_ps(nan), where));
  }
  CENOTE_VEC_OPS(_mm256, __m256, __m256i, 256, 8)
  static void sums(const float* dots, int64_t n, float* out) {
    for (int64_t j = 0; j < n; ++j) {
      const R v = load(dots + j * kLanes);
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[j] = _mm_cvtss_f32(s);
    }
  }
};
#endif
#undef CENOTE_VEC_OPS

// Ask for the cache lines of x[0, n) (a hint: no fault, no wait).
template <typename T>
inline void prefetch(const T* x, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(x);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

// SIMD passes (head size a multiple of 2 * kLanes) for NG query heads at once, so that each key
// or value row is loaded and widened once for all of them. `dots`: NG * kLanes * kLanes floats,
// the dot products' lanes of up to kLanes keys before their sums.
template <typename T, int NG>
void scores_simd(const float* query, const T* keys, const T* values, const int64_t* table,
                 int64_t start, int64_t end, const Shapes& s, float* dots, float* scores) {
  const int64_t D = s.dim, L = end - start, W = Vec::kLanes, BS = s.block_size;
  for_each_run(keys, table, start, end, s, [&](const T* k, int64_t n, int64_t p) {
    // the blocks are scattered in memory: ask for the next run's keys and this run's values
    if (p + n < end) {
      const T* next = keys + table[(p + n) / BS] * BS * D;
      prefetch(next, std::min(BS, end - p - n) * D);
    }
    prefetch(values + (k - keys), n * D);
    for (int64_t first = 0; first < n; first += W) {
      const int64_t m = std::min(W, n - first);
      for (int64_t j = 0; j < m; ++j) {
        const T* key = k + (first + j) * D;
        Vec::R dot[NG], a, b;
        Vec::load2(key, a, b);
        for (int g = 0; g < NG; ++g) {
          dot[g] = Vec::add(Vec::mul(Vec::load(query + g * D), a),
                            Vec::mul(Vec::load(query + g * D + W), b));
        }
        for (int64_t d = 2 * W; d < D; d += 2 * W) {
          Vec::load2(key + d, a, b);
          for (int g = 0; g < NG; ++g) {
            dot[g] = Vec::add(dot[g], Vec::mul(Vec::load(query + g * D + d), a));
            dot[g] = Vec::add(dot[g], Vec::mul(Vec::load(query + g * D + d + W), b));
          }
        }
        for (int g = 0; g < NG; ++g) Vec::put(dots + (g * W + j) * W, dot[g]);
      }
      for (int g = 0; g < NG; ++g) {
        Vec::sums(dots + g * W * W, m, scores + g * L + p - start + first);
      }
    }
  });
}

// out[g][first, first + NP * 2 * kLanes) of the NG heads' weighted values, each element summed
// in fp32 in key order and rounded once.
template <typename T, int NG, int NP>
void values_simd(const float* weights, const T* values, const int64_t* table, int64_t start,
                 int64_t end, const Shapes& s, int64_t first, T* out) {
  const int64_t D = s.dim, L = end - start, W = Vec::kLanes;
  Vec::R sum[NG][2 * NP];
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < 2 * NP; ++c) sum[g][c] = Vec::zero();
  }
  for_each_run(values + first, table, start, end, s, [&](const T* v, int64_t n, int64_t p) {
    for (int64_t j = 0; j < n; ++j, v += D) {
      Vec::R w[NG];
      for (int g = 0; g < NG; ++g) w[g] = Vec::set1(weights[g * L + p - start + j]);
      for (int c = 0; c < NP; ++c) {
        Vec::R a, b;
        Vec::load2(v + 2 * c * W, a, b);
        for (int g = 0; g < NG; ++g) {
          sum[g][2 * c] = Vec::add(sum[g][2 * c], Vec::mul(w[g], a));
          sum[g][2 * c + 1] = Vec::add(sum[g][2 * c + 1], Vec::mul(w[g], b));
        }
      }
    }
  });
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NP; ++c) {
      Vec::store2(out + g * D + first + 2 * c * W, sum[g][2 * c], sum[g][2 * c + 1]);
    }
  }
}

// f(std::integral_constant<int, n>) for n in 1..4.
template <typename F>
inline void with_count(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}
#endif

// One thread's buffers, kept across calls: the scaled fp32 query heads [G, D], their scores
// then weights [G, L], the weighted sums [G, D] (portable loops), the vector sums' dots.
struct Scratch {
  std::vector<float> query, scores, acc, dots;
};

#ifdef CENOTE_VEC
// The vector passes over all G query heads, in groups of up to 4 (the registers they hold).
template <typename T>
void scores_vec(const T* q, const T* keys, const T* values, const int64_t* table, int64_t start,
                int64_t end, const Shapes& s, float scale, Scratch& scratch, float* scores) {
  const int64_t G = s.group, D = s.dim, L = end - start;
  float* query = scratch.query.data();
  const Vec::R factor = Vec::set1(scale);
  for (int64_t i = 0; i < G * D; i += 2 * Vec::kLanes) {  // in load2's order, as the keys
    Vec::R a, b;
    Vec::load2(q + i, a, b);
    Vec::store2(query + i, Vec::mul(a, factor), Vec::mul(b, factor));
  }
  scratch.dots.resize(4 * Vec::kLanes * Vec::kLanes);
  for (int64_t g = 0; g < G; g += 4) {
    with_count(G - g, [&](auto heads) {
      scores_simd<T, heads>(query + g * D, keys, values, table, start, end, s,
                            scratch.dots.data(), scores + g * L);
    });
  }
}

template <typename T>
void values_vec(const float* weights, const T* values, const int64_t* table, int64_t start,
                int64_t end, const Shapes& s, T* out) {
  const int64_t G = s.group, D = s.dim, L = end - start;
  const int64_t pairs = D / (2 * Vec::kLanes);
  for (int64_t g = 0; g < G; g += 4) {
    for (int64_t c = 0; c < pairs; c += Vec::kPairs) {
      with_count(G - g, [&](auto heads) {
        with_count(std::min<int64_t>(pairs - c, Vec::kPairs), [&](auto count) {
          values_simd<T, heads, count>(weights + g * L, values, table, start, end, s,
                                       2 * c * Vec::kLanes, out + g * D);
        });
      });
    }
  }
}
#endif

// One query row's G query heads against their kv head: scores, softmax, weighted values.
template <typename T>
void attend_row_head(const T* q, const T* keys, const T* values, const int64_t* table,
                     int64_t start, int64_t end, const Shapes& s, float scale, float softcap,
                     Scratch& scratch, T* out) {
  const int64_t G = s.group, D = s.dim, L = end - start;
  scratch.query.resize(G * D);
  scratch.scores.resize(G * L);
  float* scores = scratch.scores.data();
  bool simd = false;  // the vector passes take head sizes of whole register pairs
#ifdef CENOTE_VEC
  simd = D % (2 * Vec::kLanes) == 0;
#endif
  // 1) scores
#ifdef CENOTE_VEC
  if (simd) scores_vec(q, keys, values, table, start, end, s, scale, scratch, scores);
#endif
  if (!simd) {
    float* query = scratch.query.data();
    for (int64_t i = 0; i < G * D; ++i) query[i] = to_float(q[i]) * scale;
    scores_portable(query, keys, table, start, end, s, scores);
  }
  // 2) softmax per query head (softcap first)
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    if (softcap > 0.0f) {
      for (int64_t j = 0; j < L; ++j) sg[j] = softcap * std::tanh(sg[j] / softcap);
    }
    const float top = row_max(sg, L);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < L; ++j) {
      sg[j] = exp_nonpositive(sg[j] - top);
      total += sg[j];
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < L; ++j) sg[j] *= inverse;
  }
  // 3) weighted sum of values, accumulated in fp32, rounded once
#ifdef CENOTE_VEC
  if (simd) values_vec(scores, values, table, start, end, s, out);
#endif
  if (!simd) {
    scratch.acc.resize(G * D);
    float* acc = scratch.acc.data();
    values_portable(scores, values, table, start, end, s, acc);
    for (int64_t i = 0; i < G * D; ++i) store(out + i, acc[i]);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
         const at::Tensor& starts, const at::Tensor& ends, float scale, float softcap,
         at::Tensor& out) {
  const Shapes s{q.size(0), q.size(1), q.size(2), kv_cache.size(1), kv_cache.size(2),
                 kv_cache.size(3), q.size(1) / kv_cache.size(1)};
  const T* q_data = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t head_stride = s.num_blocks * s.block_size * s.dim;  // one kv head's blocks
  const int64_t values_offset = s.kv_heads * head_stride;
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t table_stride = tables.stride(0);
  const int64_t* start_data = starts.data_ptr<int64_t>();
  const int64_t* end_data = ends.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t finish) {
    thread_local Scratch scratch;
    for (int64_t item = begin; item < finish; ++item) {
      const int64_t r = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t first_head = h * s.group;
      attend_row_head<T>(q_data + r * q_stride + first_head * s.dim, cache + h * head_stride,
                         cache + values_offset + h * head_stride,
                         table_data + r * table_stride, start_data[r], end_data[r], s, scale,
                         softcap, scratch, out_data + (r * s.heads + first_head) * s.dim);
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& key_starts,
                           const at::Tensor& key_ends, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [rows, heads, dim] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "kv_cache must be a contiguous [2, kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(1) == 0,
              "head dims or head counts do not match");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.scalar_type() == at::kLong && block_tables.size(0) == q.size(0),
              "block_tables must be int64 [rows, max_blocks] with contiguous rows");
  TORCH_CHECK(key_starts.is_contiguous() && key_ends.is_contiguous() &&
                  key_starts.scalar_type() == at::kLong && key_ends.scalar_type() == at::kLong &&
                  key_starts.numel() == q.size(0) && key_ends.numel() == q.size(0),
              "key_starts and key_ends must be contiguous int64 [rows]");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, kv_cache, block_tables, key_starts, key_ends, scale, softcap, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, kv_cache, block_tables, key_starts, key_ends, scale, softcap, out);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, not ", q.scalar_type());
  }
  return out;
}
