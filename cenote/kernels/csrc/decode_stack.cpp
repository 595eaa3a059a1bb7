// The layer loop of a llama-family decode step in C++: for steps where every row is one new
// token of its request, Python's per-layer dispatch (module calls, views, contiguous copies, the
// attention plan lookups: ~20 torch ops a layer) cost about a third of a one-stream step.
// ``DecodeStack`` holds the layers' weights once (quantized, oneDNN-prepacked dense, or both)
// and runs the same ops in the same order with the same kernels (quant_matmul or
// mkldnn::_linear_pointwise, rotary_, the KV write, cenote::paged_attention,
// add_rms_norm_, silu_and_mul), so its results are bit-identical to
// LlamaModel._forward_fused. A step with LoRA rows adds each projection's adapter updates
// right after its base product, with the kernel the linear layers call (lora_shrink_expand)
// on the segments cenote/runner/decode_stack.py builds for the step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "include/ops.h"

namespace {

// A projection as models/layers/quant.py QuantLinear or linear.py TrunkLinear multiplies it:
// up to ``fused_max_rows`` rows by the fused quantized kernel (fp32 activations in, the caller's
// dtype out), bf16 rows up to ``dot_max_rows`` by the bf16 dot-product kernel, more rows (or a
// dense layer) by the oneDNN-prepacked weight in its dtype.
struct Linear {
  c10::optional<at::Tensor> q, scale, mn;  // the quantized weight, if any
  int64_t bits, group, fused_max_rows;
  int64_t dot_max_rows;  // bf16 rows above fused_max_rows up to this: quant_matmul_dot
  c10::optional<at::Tensor> packed;  // mkldnn-prepacked dense weight, if any
  at::ScalarType dense_dtype;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (q.has_value() && x.size(0) <= fused_max_rows) {
      const bool native = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
      at::Tensor out = native ? quant_matmul(x.contiguous(), *q, *scale, mn, bits, group)
                              : quant_matmul(x.to(at::kFloat).contiguous(), *q, *scale, mn,
                                             bits, group)
                                    .to(x.scalar_type());
      return bias.has_value() ? out + *bias : out;
    }
    if (q.has_value() && x.scalar_type() == at::kBFloat16 && x.size(0) <= dot_max_rows) {
      at::Tensor out = quant_matmul_dot(x.contiguous(), *q, *scale, mn, bits, group);
      return bias.has_value() ? out + *bias : out;
    }
    TORCH_CHECK(packed.has_value(), "no dense weight for ", x.size(0), " rows");
    static auto linear =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    c10::optional<at::Tensor> dense_bias;
    if (bias.has_value()) dense_bias = bias->to(dense_dtype);
    torch::jit::Stack stack{x.to(dense_dtype).contiguous(), *packed, dense_bias,
                            std::string("none"), c10::List<c10::optional<c10::Scalar>>(),
                            std::string("")};
    linear.callBoxed(&stack);
    return stack[0].toTensor().to(x.scalar_type());
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor post_norm, next_norm;  // post-attention norm; the next layer's input norm (or final)
  double post_eps, next_eps, scale;
  int64_t cache_index;  // this layer's KV cache in the step's list
};

// Keys and values of the step's rows into their slots: cache [2, kv_heads, slots, dim].
void write_kv(const at::Tensor& cache, const at::Tensor& qkv, int64_t k_col, int64_t v_col,
              const at::Tensor& slot_mapping, int64_t kv_heads, int64_t dim) {
  const int64_t rows = qkv.size(0), slots = cache.numel() / (2 * kv_heads * dim);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = cache.element_size(), row_stride = qkv.stride(0);
  char* base = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(qkv.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < slots, "slot ", slot[r], " outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t which = 0; which < 2; ++which) {
        const int64_t col = (which == 0 ? k_col : v_col) + h * dim;
        char* dst = base + (((which * kv_heads + h) * slots + slot[r]) * dim) * elem;
        std::memcpy(dst, src + (r * row_stride + col) * elem, dim * elem);
      }
    }
  }
}

// The step's LoRA segments (one adapter's rows times one block of a projection's output
// columns), flat over every projection of every layer in stack order (qkv, o, gate_up, down):
// projection p owns segments offsets[p] .. offsets[p + 1]. Empty offsets: no LoRA row.
struct StepLoRA {
  const std::vector<at::Tensor>& a;  // [rank, in] each
  const std::vector<at::Tensor>& b;  // [block columns, rank] each, scaling folded in
  const std::vector<int64_t>& row_starts;
  const std::vector<int64_t>& row_ends;
  const std::vector<int64_t>& col_starts;
  const std::vector<int64_t>& offsets;
  std::vector<double> scales;  // all 1.0: the scaling is in b, as the linear layers pass it

  // ``out`` (projection ``p``'s base product of ``x``) plus its segments' updates, in place.
  void add(int64_t p, const at::Tensor& x, at::Tensor& out) const {
    if (offsets.empty()) return;
    const int64_t first = offsets[p], count = offsets[p + 1] - offsets[p];
    if (count == 0) return;
    lora_shrink_expand(out, x, at::TensorList(a).slice(first, count),
                       at::TensorList(b).slice(first, count),
                       c10::IntArrayRef(row_starts).slice(first, count),
                       c10::IntArrayRef(row_ends).slice(first, count),
                       c10::IntArrayRef(col_starts).slice(first, count),
                       c10::ArrayRef<double>(scales).slice(first, count));
  }
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {}

  // Four calls (qkv, o, gate_up, down), then add_layer. A quantized projection gives q, scale,
  // mn, bits, group and fused_max_rows; one with a prepacked dense weight (its own, or a
  // quantized layer's dense copy) gives packed and dense_dtype.
  void add_linear(c10::optional<at::Tensor> q, c10::optional<at::Tensor> scale,
                  c10::optional<at::Tensor> mn, int64_t bits, int64_t group,
                  int64_t fused_max_rows, int64_t dot_max_rows, c10::optional<at::Tensor> packed,
                  at::ScalarType dense_dtype, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(q.has_value() == scale.has_value(), "a quantized weight needs its scales");
    TORCH_CHECK(q.has_value() || packed.has_value(), "a projection needs a weight");
    const int64_t rows = q.has_value() ? fused_max_rows : 0;
    const int64_t dot_rows = q.has_value() ? dot_max_rows : 0;
    pending_.push_back({std::move(q), std::move(scale), std::move(mn), bits, group, rows,
                        dot_rows, std::move(packed), dense_dtype, std::move(bias)});
  }

  void add_layer(at::Tensor post_norm, double post_eps, at::Tensor next_norm, double next_eps,
                 double scale, int64_t cache_index) {
    TORCH_CHECK(pending_.size() == 4, "add_layer needs 4 linears (qkv, o, gate_up, down), got ",
                pending_.size());
    layers_.push_back({pending_[0], pending_[1], pending_[2], pending_[3], std::move(post_norm),
                       std::move(next_norm), post_eps, next_eps, scale, cache_index});
    pending_.clear();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // ``hidden``: the first layer's normed input; ``residual``: its un-normed input (updated in
  // place). Returns the final norm's output. tables/starts/ends: each layer's decode plan.
  // lora_*: the step's LoRA segments (see StepLoRA); all empty where no row has an adapter.
  at::Tensor run(at::Tensor residual, at::Tensor hidden, const at::Tensor& cos,
                 const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
                 const at::Tensor& slot_mapping, const std::vector<at::Tensor>& tables,
                 const std::vector<at::Tensor>& starts, const std::vector<at::Tensor>& ends,
                 const std::vector<at::Tensor>& lora_a, const std::vector<at::Tensor>& lora_b,
                 const std::vector<int64_t>& lora_row_starts,
                 const std::vector<int64_t>& lora_row_ends,
                 const std::vector<int64_t>& lora_col_starts,
                 const std::vector<int64_t>& lora_offsets) {
    const int64_t n = num_layers();
    TORCH_CHECK(static_cast<int64_t>(tables.size()) == n &&
                    static_cast<int64_t>(starts.size()) == n &&
                    static_cast<int64_t>(ends.size()) == n,
                "one decode plan per layer");
    const size_t segments = lora_a.size();
    TORCH_CHECK(lora_b.size() == segments && lora_row_starts.size() == segments &&
                    lora_row_ends.size() == segments && lora_col_starts.size() == segments,
                "one factor pair, row range and column start per LoRA segment");
    TORCH_CHECK(lora_offsets.empty() ||
                    (static_cast<int64_t>(lora_offsets.size()) == 4 * n + 1 &&
                     lora_offsets.front() == 0 &&
                     lora_offsets.back() == static_cast<int64_t>(segments)),
                "LoRA offsets: 4 projections x ", n, " layers + 1 entries from 0 to ", segments,
                ", got ", lora_offsets.size());
    for (size_t p = 0; p + 1 < lora_offsets.size(); ++p)
      TORCH_CHECK(lora_offsets[p] <= lora_offsets[p + 1], "LoRA offsets must not decrease");
    const StepLoRA lora{lora_a,          lora_b,       lora_row_starts,
                        lora_row_ends,   lora_col_starts, lora_offsets,
                        std::vector<double>(segments, 1.0)};
    TORCH_CHECK(residual.is_contiguous() && hidden.is_contiguous(), "rows must be contiguous");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == hidden.size(0),
                "slot_mapping must be int64 [rows]");
    static auto paged = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("cenote::paged_attention", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, double, double)>();
    const int64_t rows = hidden.size(0), q_size = heads_ * head_dim_;
    const int64_t kv_size = kv_heads_ * head_dim_;
    for (int64_t i = 0; i < n; ++i) {
      const Layer& layer = layers_[i];
      at::Tensor qkv = layer.qkv(hidden);
      lora.add(4 * i, hidden, qkv);
      rotary_(qkv, cos, sin, q_size + kv_size);
      const at::Tensor& cache = kv_caches.at(layer.cache_index);
      TORCH_CHECK(cache.scalar_type() == qkv.scalar_type() && cache.is_contiguous(),
                  "the KV cache must be contiguous in the activations' dtype");
      write_kv(cache, qkv, q_size, q_size + kv_size, slot_mapping, kv_heads_, head_dim_);
      at::Tensor q = qkv.slice(1, 0, q_size).view({rows, heads_, head_dim_});
      at::Tensor attended = paged.call(q, cache, tables[i], starts[i], ends[i], layer.scale, 0.0);
      const at::Tensor heads_out = attended.view({rows, q_size});
      at::Tensor out = layer.o(heads_out);
      lora.add(4 * i + 1, heads_out, out);
      add_rms_norm_(out, residual, layer.post_norm, layer.post_eps);  // residual += attention
      at::Tensor gate_up = layer.gate_up(out);
      lora.add(4 * i + 2, out, gate_up);
      const at::Tensor activated = silu_and_mul(gate_up);
      hidden = layer.down(activated);
      lora.add(4 * i + 3, activated, hidden);
      add_rms_norm_(hidden, residual, layer.next_norm, layer.next_eps);  // residual += mlp
    }
    return hidden;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  std::vector<Linear> pending_;
  std::vector<Layer> layers_;
};

}  // namespace

// torch.classes.cenote.DecodeStack: holds tensors, so a custom class (refcounted by
// torch) rather than a pybind11 class.
TORCH_LIBRARY_FRAGMENT(cenote, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("add_linear", &DecodeStack::add_linear)
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run);
}
