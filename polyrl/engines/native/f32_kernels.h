// The float32 versions of the decode step's fused kernels (f32_kernels.cpp): the operators in
// decode_kernels.cpp and attention_kernel.cpp hand float32 tensors to these, so one operator serves the bf16
// path and the float32 one (a CPU without native bf16, or a model trained in float32).

#pragma once

#include <ATen/ATen.h>

namespace polyrl_native::f32 {

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);

void rope_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys, at::Tensor values,
                int64_t position, int64_t heads, int64_t kv_heads);

at::Tensor silu_mul(const at::Tensor& gate_up);

at::Tensor attention(const at::Tensor& qkv, const c10::optional<at::Tensor>& prefix_keys,
                     const c10::optional<at::Tensor>& prefix_values, const c10::optional<at::Tensor>& prefix_bias,
                     const c10::optional<at::Tensor>& row_prompt, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias, int64_t length, double scale, int64_t heads,
                     int64_t kv_heads);

}  // namespace polyrl_native::f32
