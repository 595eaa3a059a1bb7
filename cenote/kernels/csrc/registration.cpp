// The ``cenote`` torch library: every kernel's schema and its CPU registration, in one place
// (the DecodeStack class joins from decode_stack.cpp, where it is defined). Ops are reached from
// Python as ``torch.ops.cenote.<op>`` through cenote.kernels (``quant_ops()``, ``attention_ops()``).
//
// Registered through the dispatcher rather than as a pybind11 module: no file includes
// torch/extension.h (30 s of compile time per file, measured), and a tensor op called with CUDA
// tensors fails with the dispatcher's "not implemented for CUDA" instead of reading device
// memory on the host. In-place ops declare what they write ((a!)), so a tracer never reorders
// them. A call costs about 2 us of dispatch (0.7 us through pybind11; docs/performance.md).

#include <torch/library.h>

#include "include/ops.h"

TORCH_LIBRARY(cenote, m) {
  // x [M, K] @ dequant(q [N, K]).T for few rows (fused), in x's dtype
  m.def("quant_matmul(Tensor x, Tensor q, Tensor scale, Tensor? mn, int bits, int group) -> Tensor");
  // the same on bf16 dot products (AVX512-BF16)
  m.def(
      "quant_matmul_dot(Tensor x, Tensor q, Tensor scale, Tensor? mn, int bits, int group) "
      "-> Tensor");
  // the same with x quantized to 8 bits per block of 32
  m.def(
      "quant_matmul_q8(Tensor x, Tensor q, Tensor scale, Tensor? mn, int bits, int group) "
      "-> Tensor");
  // the dense weight (fp32 or bf16) of a quantized one, optionally into ``buffer``
  m.def(
      "quant_dequantize(Tensor q, Tensor scale, Tensor? mn, int bits, int group, "
      "ScalarType dtype, Tensor(a!)? buffer) -> Tensor");
  m.def("quant_dot_supported() -> bool", &quant_dot_supported);
  m.def("compiled_isa() -> str[]", &compiled_isa);
  // residual += x; x = rms_norm(residual), in place
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin, int width) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor words) -> Tensor(a!)");
  m.def("layer_norm_(Tensor(a!) x, Tensor weight, Tensor bias, float eps) -> ()");
  m.def(
      "add_layer_norm_(Tensor(a!) x, Tensor? residual, Tensor weight, Tensor bias, float eps) "
      "-> ()");
  m.def("int8_supported() -> bool", &int8_supported);
  m.def("int8_pack(Tensor weight) -> Tensor[]");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor col_sums, Tensor? bias, "
      "Tensor? residual, bool gelu) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor key_starts, "
      "Tensor key_ends, float scale, float softcap) -> Tensor");
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, "
      "int[] lengths, float scale, bool causal, Tensor? alibi_slopes=None) -> ()");
  m.def("varlen_micro_kernels() -> bool", &bf16_micro_kernels);
  // out[rows_s, cols_s] += scale_s * (x[rows_s] @ a_s^T) @ b_s^T for every segment s, in place
  m.def(
      "lora_shrink_expand(Tensor(a!) out, Tensor x, Tensor[] a, Tensor[] b, int[] row_starts, "
      "int[] row_ends, int[] col_starts, float[] scales) -> ()");
}

TORCH_LIBRARY_IMPL(cenote, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
  m.impl("quant_matmul_dot", &quant_matmul_dot);
  m.impl("quant_matmul_q8", &quant_matmul_q8);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("layer_norm_", &layer_norm_);
  m.impl("add_layer_norm_", &add_layer_norm_);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_linear", &int8_linear);
  m.impl("paged_attention", &paged_attention);
  m.impl("varlen_attention", &varlen_attention);
  m.impl("lora_shrink_expand", &lora_shrink_expand);
}
