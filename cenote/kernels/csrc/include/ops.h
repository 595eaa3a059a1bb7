// Every op of the ``cenote`` torch library, as its source file defines it; registration.cpp
// gives each its schema and registers it. One declaration here, so a file that calls another
// file's op (decode_stack.cpp) and the registration cannot drift from the definition.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// quant_linear.cpp: weight-only 4/8-bit matmuls and dequantization
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& mn, int64_t bits, int64_t group);
at::Tensor quant_matmul_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& mn, int64_t bits, int64_t group);
at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& mn, int64_t bits, int64_t group,
                            at::ScalarType dtype, const std::optional<at::Tensor>& buffer);
bool quant_dot_supported();
std::vector<std::string> compiled_isa();
// q8_linear.cpp: 8-bit activations against 4/8-bit weights on integer dot products
at::Tensor quant_matmul_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const std::optional<at::Tensor>& mn, int64_t bits, int64_t group);
// fused_ops.cpp: the decoder and encoder layers' elementwise steps, the sampler's argmax
void add_rms_norm_(at::Tensor x, const std::optional<at::Tensor>& residual,
                   const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t width);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor apply_token_bitmask_(at::Tensor logits, const at::Tensor& rows, const at::Tensor& words);
void layer_norm_(at::Tensor x, const at::Tensor& weight, const at::Tensor& bias, double eps);
void add_layer_norm_(at::Tensor x, const std::optional<at::Tensor>& residual,
                     const at::Tensor& weight, const at::Tensor& bias, double eps);
// int8_linear.cpp: w8a8 linears
bool int8_supported();
std::vector<at::Tensor> int8_pack(const at::Tensor& weight);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& col_sums, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, bool gelu);
// paged_attention.cpp: decode rows against the paged KV cache
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& key_starts,
                           const at::Tensor& key_ends, double scale, double softcap);
// varlen_attention.cpp: whole prompts, each request attending to its own rows
void varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& out, c10::IntArrayRef starts, c10::IntArrayRef lengths,
                      double scale, bool causal, const std::optional<at::Tensor>& alibi_slopes);
bool bf16_micro_kernels();
// lora.cpp: every adapter's low-rank update of one linear layer, per segment of rows
void lora_shrink_expand(at::Tensor out, const at::Tensor& x, at::TensorList a, at::TensorList b,
                        c10::IntArrayRef row_starts, c10::IntArrayRef row_ends,
                        c10::IntArrayRef col_starts, c10::ArrayRef<double> scales);
