// Fused CPU kernels for one decode step of the fused Llama decode path (polyrl/engines/llama_decode.py).
//
// Why: at RL batch sizes a decode step on a CPU spends as long in the small operations between the matmuls
// (norms, rotary, attention over a few hundred keys, SiLU) as in the matmuls, mostly in per-operation
// overhead and in extra passes over memory. Each kernel here (attention in attention_kernel.cpp, the head and
// sampler in sampling_kernels.cpp) does one of those groups in one pass and rounds to bfloat16 exactly where
// the torch operations it replaces do, so results agree with them to the order of float32 summation
// (tests/test_native_kernels.py).
//
// Registered as torch operators (namespace polyrl_native); built on first use by polyrl/engines/native. Float32
// tensors go to the float32 versions (f32_kernels.cpp).

#include "f32_kernels.h"
#include "kernels_common.h"

namespace {

using namespace polyrl_native;

// x <- bf16(x + delta) (when delta is given), then returns bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))):
// the residual add and Llama's RMSNorm as torch computes them in bfloat16 (statistics in float32).
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  if (x.scalar_type() == at::kFloat) return f32::add_rms_norm(x, delta, weight, eps);
  check_bf16_2d(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  const bool add = delta.has_value();
  if (add) check_bf16_2d(*delta, "delta");
  auto w = weight.contiguous();
  auto out = at::empty({rows, width}, x.options());
  bf16* xp = x.data_ptr<bf16>();
  const bf16* dp = add ? delta->data_ptr<bf16>() : nullptr;
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0), ds = add ? delta->stride(0) : 0;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> v(width);
    for (int64_t i = begin; i < end; ++i) {
      bf16* xr = xp + i * xs;
      float ss = 0.f;
      int64_t j0 = 0;
#ifdef __AVX512F__
      __m512 acc = _mm512_setzero_ps();
      for (; j0 + 16 <= width; j0 += 16) {
        __m512 a = load16(xr + j0);
        if (add) {
          a = rnd16(_mm512_add_ps(a, load16(dp + i * ds + j0)));
          store16(xr + j0, a);
        }
        _mm512_storeu_ps(v.data() + j0, a);
        acc = _mm512_fmadd_ps(a, a, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (int64_t j = j0; j < width; ++j) {
        float a = add ? f(r(f(xr[j]) + f(dp[i * ds + j]))) : f(xr[j]);
        v[j] = a;
        ss += a * a;
      }
      if (add)
        for (int64_t j = j0; j < width; ++j) xr[j] = r(v[j]);
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
      bf16* o = op + i * width;
      int64_t j1 = 0;
#ifdef __AVX512F__
      const __m512 rs = _mm512_set1_ps(rstd);
      for (; j1 + 16 <= width; j1 += 16)
        store16(o + j1, _mm512_mul_ps(load16(wp + j1), rnd16(_mm512_mul_ps(_mm512_loadu_ps(v.data() + j1), rs))));
#endif
      for (int64_t j = j1; j < width; ++j) o[j] = r(f(wp[j]) * f(r(v[j] * rstd)));
    }
  });
  return out;
}

// Rotary embedding of the query and key heads of ``qkv`` [B, (heads + 2 kv_heads) * d] as
// bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)); the rotated queries are written back into ``qkv``, the
// rotated keys into ``keys`` [B, kv_heads, d, capacity] (transposed) and the values into ``values``
// [B, kv_heads, capacity, d], at ``position``.
void rope_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys, at::Tensor values,
                int64_t position, int64_t heads, int64_t kv_heads) {
  if (qkv.scalar_type() == at::kFloat) return f32::rope_write(qkv, cos, sin, keys, values, position, heads, kv_heads);
  check_bf16_2d(qkv, "qkv");
  TORCH_CHECK(keys.dtype() == at::kBFloat16 && values.dtype() == at::kBFloat16, "keys and values must be bf16");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys and values must be contiguous");
  const int64_t rows = qkv.size(0), d = values.size(3), cap = values.size(2), half = d / 2;
  TORCH_CHECK(keys.size(2) == d && keys.size(3) == cap, "keys must be [B, kv_heads, head_dim, capacity]");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv width does not match the heads");
  TORCH_CHECK(position >= 0 && position < cap, "position outside the key buffer");
  auto c = cos.reshape({rows, d}).contiguous(), s = sin.reshape({rows, d}).contiguous();
  TORCH_CHECK(c.dtype() == at::kBFloat16 && s.dtype() == at::kBFloat16, "cos and sin must be bf16");
  bf16* qp = qkv.data_ptr<bf16>();
  const bf16* cp = c.data_ptr<bf16>();
  const bf16* sp = s.data_ptr<bf16>();
  bf16* kp = keys.data_ptr<bf16>();
  bf16* vp = values.data_ptr<bf16>();
  const int64_t qs = qkv.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<bf16> tmp(d);
    for (int64_t b = begin; b < end; ++b) {
      bf16* row = qp + b * qs;
      const bf16* cb = cp + b * d;
      const bf16* sb = sp + b * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        bf16* x = row + h * d;
        bf16* dst = h < heads ? x : tmp.data();
#ifdef __AVX512F__
        if (half % 16 == 0) {
          for (int64_t j = 0; j < half; j += 16) {
            const __m512 lo = load16(x + j), hi = load16(x + j + half);
            const __m512 a = rnd16(_mm512_mul_ps(lo, load16(cb + j)));
            const __m512 b2 = rnd16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), load16(sb + j)));
            const __m512 c2 = rnd16(_mm512_mul_ps(hi, load16(cb + j + half)));
            const __m512 s2 = rnd16(_mm512_mul_ps(lo, load16(sb + j + half)));
            store16(dst + j, _mm512_add_ps(a, b2));
            store16(dst + j + half, _mm512_add_ps(c2, s2));
          }
        } else
#endif
        {
          for (int64_t j = 0; j < d; ++j) {
            const float rot = j < half ? -f(x[j + half]) : f(x[j - half]);
            tmp[j] = r(f(r(f(x[j]) * f(cb[j]))) + f(r(rot * f(sb[j]))));
          }
          for (int64_t j = 0; j < d; ++j) dst[j] = tmp[j];
        }
        if (h >= heads) {
          bf16* kt = kp + (b * kv_heads + (h - heads)) * d * cap + position;
          for (int64_t j = 0; j < d; ++j) kt[j * cap] = tmp[j];
        }
      }
      const bf16* v = row + (heads + kv_heads) * d;
      for (int64_t h = 0; h < kv_heads; ++h) {
        bf16* dst = vp + ((b * kv_heads + h) * cap + position) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = v[h * d + j];
      }
    }
  });
}

// bf16(bf16(silu(gate)) * up) for ``gate_up`` [B, 2 I] holding gate then up: the MLP's activation.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  if (gate_up.scalar_type() == at::kFloat) return f32::silu_mul(gate_up);
  check_bf16_2d(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* gate = gp + i * gs;
      const bf16* up = gate + inner;
      bf16* o = op + i * inner;
      int64_t j0 = 0;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.f);
      for (; j0 + 16 <= inner; j0 += 16) {
        const __m512 x = load16(gate + j0);
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
        store16(o + j0, _mm512_mul_ps(rnd16(_mm512_div_ps(x, _mm512_add_ps(one, e))), load16(up + j0)));
      }
#endif
      for (int64_t j = j0; j < inner; ++j) {
        const float x = f(gate[j]);
        o[j] = r(f(r(x / (1.f + std::exp(-x)))) * f(up[j]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(polyrl_native, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_write(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) keys, Tensor(c!) values, int position, "
        "int heads, int kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_write", &rope_write);
  m.impl("silu_mul", &silu_mul);
}
