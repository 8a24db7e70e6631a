// A whole decode step's layer stack in one call, for the bf16 path on polyrl's own matmul (bf16_linear.cpp):
// per layer the same kernels, in the same order, as llama_decode.LlamaDecoder._decode_native runs from Python
// (residual add with RMSNorm, the q/k/v matmul, rotary with the key/value write, attention, the output
// projection, gate/up, SiLU-and-multiply, down), so the results are those of the Python loop to the bit.
//
// Why: at 16 rows a layer's kernels take tens of microseconds each, and the Python loop and the operator
// dispatch around its nine calls add a few microseconds per call: several percent of a decode step.

#include "kernels_common.h"

namespace {

// The residual stream ``x`` [B, H] (updated in place) through every layer; returns the final-normed hidden
// states [B, H] for the head. Per layer ``i``: ``in_norms[i]``, ``post_norms[i]``, the packed matmul weights
// ``qkv[i]``, ``o[i]``, ``gate_up[i]``, ``down[i]`` with their output widths ``outs`` (qkv, o, gate_up, down),
// ``qkv_bias[i]`` where the model has one (else the list is empty), the row's own key/value buffers and, where
// the rows share prompts, the prompts' (empty lists otherwise). ``position`` is the row's own position written
// this step.
at::Tensor decode_stack(at::Tensor x, at::TensorList in_norms, at::TensorList post_norms, const at::Tensor& final_norm,
                        at::TensorList qkv, at::TensorList qkv_bias, at::TensorList o, at::TensorList gate_up,
                        at::TensorList down, at::IntArrayRef outs, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList keys, at::TensorList values, at::TensorList prefix_keys,
                        at::TensorList prefix_values, const c10::optional<at::Tensor>& prefix_bias,
                        const c10::optional<at::Tensor>& row_prompt, int64_t position, double eps, double scale,
                        int64_t heads, int64_t kv_heads) {
  const size_t layers = in_norms.size();
  TORCH_CHECK(layers > 0 && post_norms.size() == layers && qkv.size() == layers && o.size() == layers &&
                  gate_up.size() == layers && down.size() == layers && keys.size() == layers &&
                  values.size() == layers, "one entry per layer in every list");
  TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == layers, "qkv_bias: one per layer, or none");
  const bool shared = !prefix_keys.empty();
  TORCH_CHECK(!shared || (prefix_keys.size() == layers && prefix_values.size() == layers),
              "prefix keys and values: one per layer, or none");
  TORCH_CHECK(outs.size() == 4, "outs: the widths of qkv, o, gate_up and down");
  const c10::optional<at::Tensor> none;
  at::Tensor h = add_rms_norm(x, none, in_norms[0], eps);
  for (size_t i = 0; i < layers; ++i) {
    const c10::optional<at::Tensor> bias = qkv_bias.empty() ? none : c10::optional<at::Tensor>(qkv_bias[i]);
    at::Tensor q = polyrl_native::bf16_linear(h, qkv[i], outs[0], bias);
    rope_write(q, cos, sin, keys[i], values[i], position, heads, kv_heads);
    const c10::optional<at::Tensor> pk = shared ? c10::optional<at::Tensor>(prefix_keys[i]) : none;
    const c10::optional<at::Tensor> pv = shared ? c10::optional<at::Tensor>(prefix_values[i]) : none;
    at::Tensor att = attention(q, pk, pv, shared ? prefix_bias : none, shared ? row_prompt : none, keys[i], values[i],
                               none, position + 1, scale, heads, kv_heads);
    h = add_rms_norm(x, polyrl_native::bf16_linear(att, o[i], outs[1], none), post_norms[i], eps);
    at::Tensor up = silu_mul(polyrl_native::bf16_linear(h, gate_up[i], outs[2], none));
    h = add_rms_norm(x, polyrl_native::bf16_linear(up, down[i], outs[3], none),
                     i + 1 < layers ? in_norms[i + 1] : final_norm, eps);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyrl_native, m) {
  m.def("decode_stack(Tensor(a!) x, Tensor[] in_norms, Tensor[] post_norms, Tensor final_norm, Tensor[] qkv, "
        "Tensor[] qkv_bias, Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] outs, Tensor cos, Tensor sin, "
        "Tensor(b!)[] keys, Tensor(c!)[] values, Tensor[] prefix_keys, Tensor[] prefix_values, Tensor? prefix_bias, "
        "Tensor? row_prompt, int position, float eps, float scale, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("decode_stack", &decode_stack);
}
