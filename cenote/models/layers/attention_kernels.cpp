// Attention kernels for CPU, built at first use by torch.utils.cpp_extension with
// -O3 -march=native (see attention_kernels.py); plain loops written for the auto-vectorizer, so
// one source serves AVX2 and AVX-512 machines.
//
// paged_attention: short queries over a paged KV cache read in place (no gather of the blocks).
//   Query row r attends to the keys at positions [key_starts[r], key_ends[r]) of its block
//   table row: position p lives at slot p % block_size of block block_tables[r][p / block_size].
//   Scores are fp32 (dot products of fp32-converted q and k), softmax in fp32, the weighted sum
//   of values accumulated in fp32 and rounded once to the query's dtype.
// varlen_attention: requests of any lengths on a flat token stream, each attending only to its
//   own rows, in one call: torch's SDPA per request, scheduled across the cores (requests
//   longest first, one per thread) when there are enough of them, else one after the other
//   with SDPA's own threads. Each request's result is SDPA's on that request alone.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float* out, float x) { *out = x; }

inline void store(c10::BFloat16* out, float x) { *out = c10::BFloat16(x); }

// exp(x) for x <= 0 (a score minus the row's maximum), Cephes' single-precision polynomial,
// written so that the compiler vectorizes a loop of it.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

struct Shapes {
  int64_t rows, heads, dim, kv_heads, num_blocks, block_size, group;
};

template <typename T>
void attend_row_head(const T* q, const T* keys, const T* values, const int64_t* table,
                     int64_t start, int64_t end, const Shapes& s, float scale, float softcap,
                     std::vector<float>& scores, std::vector<float>& acc, T* out) {
  const int64_t G = s.group, D = s.dim, BS = s.block_size, L = end - start;
  scores.resize(G * L);
  acc.assign(G * D, 0.0f);
  std::vector<float> query(G * D);
  for (int64_t i = 0; i < G * D; ++i) query[i] = to_float(q[i]) * scale;
  // 1) scores, one block at a time
  for (int64_t p = start; p < end;) {
    const int64_t offset = p % BS, n = std::min(BS - offset, end - p);
    const T* k = keys + (table[p / BS] * BS + offset) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = query.data() + g * D;
      float* sg = scores.data() + g * L + (p - start);
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(k[j * D + d]);
        sg[j] = dot;
      }
    }
    p += n;
  }
  // 2) softmax per query head (softcap first)
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    if (softcap > 0.0f) {
      for (int64_t j = 0; j < L; ++j) sg[j] = softcap * std::tanh(sg[j] / softcap);
    }
    float top = sg[0];
    for (int64_t j = 1; j < L; ++j) top = std::max(top, sg[j]);
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
  // 3) weighted sum of values, one block at a time
  for (int64_t p = start; p < end;) {
    const int64_t offset = p % BS, n = std::min(BS - offset, end - p);
    const T* v = values + (table[p / BS] * BS + offset) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = scores.data() + g * L + (p - start);
      float* ag = acc.data() + g * D;
      for (int64_t j = 0; j < n; ++j) {
        const float w = pg[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += w * to_float(v[j * D + d]);
      }
    }
    p += n;
  }
  for (int64_t i = 0; i < G * D; ++i) store(out + i, acc[i]);
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
    std::vector<float> scores, acc;
    for (int64_t item = begin; item < finish; ++item) {
      const int64_t r = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t first_head = h * s.group;
      attend_row_head<T>(q_data + r * q_stride + first_head * s.dim, cache + h * head_stride,
                         cache + values_offset + h * head_stride,
                         table_data + r * table_stride, start_data[r], end_data[r], s, scale,
                         softcap, scores, acc, out_data + (r * s.heads + first_head) * s.dim);
    }
  });
}

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

void varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& out, c10::IntArrayRef starts, c10::IntArrayRef lengths,
                      double scale, bool causal) {
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
  const bool gqa = q.size(1) != k.size(1);
  auto attend = [&](int64_t r) {
    const int64_t start = starts[r], end = starts[r] + lengths[r];
    auto rows = [&](const at::Tensor& t) {  // [1, heads, length, dim] view of the request
      return t.slice(0, start, end).unsqueeze(0).transpose(1, 2);
    };
    at::Tensor result = at::scaled_dot_product_attention(rows(q), rows(k), rows(v),
                                                         std::nullopt, 0.0, causal, scale, gqa);
    out.slice(0, start, end).copy_(result[0].transpose(0, 1));
  };
  // one request per thread pays when no request alone outweighs a thread's share
  std::vector<int64_t> order(num_requests);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  const int64_t threads = at::get_num_threads();
  double total = 0.0;
  for (int64_t r = 0; r < num_requests; ++r) total += double(lengths[r]) * double(lengths[r]);
  const double longest = num_requests ? double(lengths[order[0]]) * double(lengths[order[0]]) : 0;
  if (threads > 1 && num_requests >= 2 * threads && longest * threads <= total) {
    std::atomic<int64_t> next{0};
    const at::ThreadLocalState caller;  // inference mode, grad mode, ... of the calling thread
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      at::ThreadLocalStateGuard same_state(caller);
      for (int64_t i = next++; i < num_requests; i = next++) attend(order[i]);
    });
  } else {
    for (int64_t r = 0; r < num_requests; ++r) attend(r);
  }
}

}  // namespace

TORCH_LIBRARY(cenote_attention, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor key_starts, "
      "Tensor key_ends, float scale, float softcap) -> Tensor");
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, "
      "int[] lengths, float scale, bool causal) -> ()");
}

TORCH_LIBRARY_IMPL(cenote_attention, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("varlen_attention", &varlen_attention);
}
