// Float32 kernels for one decode step of the fused Llama decode path: the residual add with RMSNorm, rotary
// with the key/value write, one-position attention over a group's shared prompt and the row's own positions,
// and SiLU-and-multiply. The same groups of operations as the bf16 kernels (decode_kernels.cpp,
// attention_kernel.cpp), each one pass over its data, with no rounding between them: they compute what the
// torch operations compute in float32, to the order of float32 summation (tests/test_native_f32.py).
//
// Vectorised through simd.h: AVX-512 or AVX2 where the build targets them, plain loops elsewhere.

#include "f32_kernels.h"

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "simd.h"
#include "attention_common.h"

namespace polyrl_native::f32 {

using namespace polyrl_simd;

namespace {

void check_f32_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_kv(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dtype() == at::kFloat && values.dtype() == at::kFloat, "keys and values must be float32");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys and values must be contiguous");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(2) == values.size(3) &&
                  keys.size(3) == values.size(2) && keys.size(1) == values.size(1),
              "keys must be [B, kv_heads, head_dim, capacity] and values [B, kv_heads, capacity, head_dim]");
}

}  // namespace

// x <- x + delta (when delta is given), then returns weight * (x * rsqrt(mean(x^2) + eps)).
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_f32_2d(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  const bool add = delta.has_value();
  if (add) check_f32_2d(*delta, "delta");
  auto w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == width, "weight must have one entry per column");
  auto out = at::empty({rows, width}, x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = add ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = add ? delta->stride(0) : 0;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * xs;
      const float* dr = add ? dp + i * ds : nullptr;
      VF acc = vzero();
      int64_t j = 0;
      for (; j + kLanes <= width; j += kLanes) {
        VF a = vload(xr + j);
        if (add) {
          a = a + vload(dr + j);
          vstore(xr + j, a);
        }
        acc = vfma(a, a, acc);
      }
      float ss = vsum(acc);
      for (; j < width; ++j) {
        if (add) xr[j] += dr[j];
        ss += xr[j] * xr[j];
      }
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
      float* o = op + i * width;
      const VF rs = vset(rstd);
      j = 0;
      for (; j + kLanes <= width; j += kLanes) vstore(o + j, vload(wp + j) * (vload(xr + j) * rs));
      for (; j < width; ++j) o[j] = wp[j] * (xr[j] * rstd);
    }
  });
  return out;
}

// Rotary embedding of the query and key heads of ``qkv`` [B, (heads + 2 kv_heads) * d] as
// x * cos + rotate_half(x) * sin; the rotated queries are written back into ``qkv``, the rotated keys into
// ``keys`` [B, kv_heads, d, capacity] (transposed) and the values into ``values`` [B, kv_heads, capacity, d],
// at ``position``.
void rope_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys, at::Tensor values,
                int64_t position, int64_t heads, int64_t kv_heads) {
  check_f32_2d(qkv, "qkv");
  check_kv(keys, values);
  const int64_t rows = qkv.size(0), d = values.size(3), cap = values.size(2), half = d / 2;
  TORCH_CHECK(keys.size(0) == rows && keys.size(1) == kv_heads, "keys must be [B, kv_heads, head_dim, capacity]");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv width does not match the heads");
  TORCH_CHECK(position >= 0 && position < cap, "position outside the key buffer");
  auto c = cos.reshape({rows, d}).to(at::kFloat).contiguous(), s = sin.reshape({rows, d}).to(at::kFloat).contiguous();
  float* qp = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t qs = qkv.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t b = begin; b < end; ++b) {
      float* row = qp + b * qs;
      const float* cb = cp + b * d;
      const float* sb = sp + b * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row + h * d;
        int64_t j = 0;
        if (half % kLanes == 0) {
          for (; j < half; j += kLanes) {
            const VF lo = vload(x + j), hi = vload(x + j + half);
            vstore(tmp.data() + j, lo * vload(cb + j) - hi * vload(sb + j));
            vstore(tmp.data() + j + half, hi * vload(cb + j + half) + lo * vload(sb + j + half));
          }
          j = d;
        }
        for (; j < d; ++j) {
          const float rot = j < half ? -x[j + half] : x[j - half];
          tmp[j] = x[j] * cb[j] + rot * sb[j];
        }
        if (h < heads) {
          for (j = 0; j < d; ++j) x[j] = tmp[j];
        } else {
          float* kt = kp + (b * kv_heads + (h - heads)) * d * cap + position;
          for (j = 0; j < d; ++j) kt[j * cap] = tmp[j];
        }
      }
      const float* v = row + (heads + kv_heads) * d;
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* dst = vp + ((b * kv_heads + h) * cap + position) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = v[h * d + j];
      }
    }
  });
}

// silu(gate) * up for ``gate_up`` [B, 2 I] holding gate then up: the MLP's activation.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_f32_2d(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const VF one = vset(1.f), zero = vzero();
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = gp + i * gs;
      const float* up = gate + inner;
      float* o = op + i * inner;
      int64_t j = 0;
      for (; j + kLanes <= inner; j += kLanes) {
        const VF x = vload(gate + j);
        vstore(o + j, x / (one + vexp(zero - x)) * vload(up + j));
      }
      for (; j < inner; ++j) o[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
    }
  });
  return out;
}

namespace {

using Segment = KVSegment<float>;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Scores of G query heads kLanes keys at a time (each key dimension one load of the transposed keys, times
// that dimension of each query), while a whole chunk lies inside the buffer; scores past ``length`` land in the
// caller's slack. Returns the first position not computed.
template <int G>
int64_t scores_g(const float* qf, int64_t d, const Segment& seg, float* scores, int64_t ss) {
  int64_t t0 = 0;
  for (; t0 + kLanes <= seg.cap && t0 < seg.length; t0 += kLanes) {
    VF acc[G];
    for (int i = 0; i < G; ++i) acc[i] = vzero();
    for (int64_t j = 0; j < d; ++j) {
      const VF kj = vload(seg.kt + j * seg.cap + t0);
      for (int i = 0; i < G; ++i) acc[i] = vfma(vset(qf[i * d + j]), kj, acc[i]);
    }
    for (int i = 0; i < G; ++i) vstore(scores + i * ss + t0, acc[i]);
  }
  return t0;
}

int64_t scores(int g, const float* qf, int64_t d, const Segment& seg, float* sc, int64_t ss) {
  return with_heads(g, [&](auto G) { return scores_g<decltype(G)::value>(qf, d, seg, sc, ss); });
}

// Softmax of each of the g score rows (``stride`` apart, ``length`` used) in place. Masked scores are -inf.
void softmax_rows(float* sc, int g, int64_t stride, int64_t length) {
  for (int i = 0; i < g; ++i) {
    float* s = sc + i * stride;
    int64_t t = 0;
    VF mv = vset(-std::numeric_limits<float>::infinity());
    for (; t + kLanes <= length; t += kLanes) mv = vmax(mv, vload(s + t));
    float m = vmaxr(mv);
    for (; t < length; ++t) m = s[t] > m ? s[t] : m;
    const VF mm = vset(m);
    VF sv = vzero();
    for (t = 0; t + kLanes <= length; t += kLanes) {
      const VF e = vexp(vload(s + t) - mm);
      vstore(s + t, e);
      sv = sv + e;
    }
    float sum = vsum(sv);
    for (; t < length; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    const VF iv = vset(inv);
    for (t = 0; t + kLanes <= length; t += kLanes) vstore(s + t, vload(s + t) * iv);
    for (; t < length; ++t) s[t] *= inv;
  }
}

// out[i, c0 : c0 + NV kLanes] = sum over the segments' positions t of p[i, t] v[t, c0 : ...], the sums in
// registers; ``p`` holds the segments' probabilities one after another (row stride ``ss``).
template <int G, int NV>
void weigh_values_g(const float* p, int64_t ss, const Segment* segs, int n, int64_t d, int64_t c0, float* out) {
  VF acc[G][NV];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = vzero();
  int64_t off = 0;
  for (int k = 0; k < n; ++k) {
    for (int64_t t = 0; t < segs[k].length; ++t) {
      VF vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = vload(segs[k].v + t * d + c0 + c * kLanes);
      for (int i = 0; i < G; ++i) {
        const VF pv = vset(p[i * ss + off + t]);
        for (int c = 0; c < NV; ++c) acc[i][c] = vfma(pv, vv[c], acc[i][c]);
      }
    }
    off += segs[k].length;
  }
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NV; ++c) vstore(out + i * d + c0 + c * kLanes, acc[i][c]);
}

// Up to 12 accumulators: G heads by NV vectors of the head dimension, NV as large as that allows.
template <int G>
void weigh_values_heads(const float* p, int64_t ss, const Segment* segs, int n, int64_t d, float* out) {
  constexpr int nv = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  int64_t c0 = 0;
  for (; c0 + nv * kLanes <= d; c0 += nv * kLanes) weigh_values_g<G, nv>(p, ss, segs, n, d, c0, out);
  for (; c0 + kLanes <= d; c0 += kLanes) weigh_values_g<G, 1>(p, ss, segs, n, d, c0, out);
}

void weigh_values(int g, const float* p, int64_t ss, const Segment* segs, int n, int64_t d, float* out) {
  return with_heads(g, [&](auto G) { return weigh_values_heads<decltype(G)::value>(p, ss, segs, n, d, out); });
}

// One query position of g heads over ``n`` segments: scores (scaled queries times keys), bias, softmax, the
// weighted values; ``scores`` has row stride ``ss`` (the segments' lengths rounded up to 16 each, plus 16).
void attend_group(const float* q, int g, int64_t d, const Segment* segs, int n, float scale, float* out,
                  float* sc, int64_t ss, float* qf) {
  for (int i = 0; i < g; ++i)
    for (int64_t j = 0; j < d; ++j) qf[i * d + j] = q[i * d + j] * scale;
  int64_t off = 0;
  for (int k = 0; k < n; ++k) {
    const Segment& seg = segs[k];
    float* s = sc + off;
    for (int64_t t = scores(g, qf, d, seg, s, ss); t < seg.length; ++t)
      for (int i = 0; i < g; ++i) {
        float acc = 0.f;
        for (int64_t j = 0; j < d; ++j) acc += qf[i * d + j] * seg.kt[j * seg.cap + t];
        s[i * ss + t] = acc;
      }
    if (seg.bias)
      for (int i = 0; i < g; ++i)
        for (int64_t t = 0; t < seg.length; ++t) s[i * ss + t] += seg.bias[t];
    off += seg.length;
  }
  softmax_rows(sc, g, ss, off);
  const int64_t dv = d / kLanes * kLanes;
  if (dv) weigh_values(g, sc, ss, segs, n, d, out);
  if (dv == d) return;
  for (int i = 0; i < g; ++i)
    for (int64_t j = dv; j < d; ++j) out[i * d + j] = 0.f;
  off = 0;
  for (int k = 0; k < n; ++k) {
    for (int64_t t = 0; t < segs[k].length; ++t) {
      const float* vt = segs[k].v + t * d;
      for (int i = 0; i < g; ++i) {
        const float p = sc[i * ss + off + t];
        for (int64_t j = dv; j < d; ++j) out[i * d + j] += p * vt[j];
      }
    }
    off += segs[k].length;
  }
}

}  // namespace

// As attention_kernel.cpp's ``attention``, in float32: one query position per row over its group's shared
// prompt (``prefix_*``, ``row_prompt``) and its own first ``length`` positions; returns [B, heads * d].
at::Tensor attention(const at::Tensor& qkv, const c10::optional<at::Tensor>& prefix_keys,
                     const c10::optional<at::Tensor>& prefix_values, const c10::optional<at::Tensor>& prefix_bias,
                     const c10::optional<at::Tensor>& row_prompt, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias, int64_t length, double scale, int64_t heads,
                     int64_t kv_heads) {
  check_f32_2d(qkv, "qkv");
  check_kv(keys, values);
  const int64_t rows = qkv.size(0), d = values.size(3), cap = values.size(2);
  const int64_t g = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && g <= 8, "at most 8 query heads per key/value head");
  TORCH_CHECK(qkv.size(1) >= heads * d && keys.size(0) == rows && keys.size(1) == kv_heads, "shapes differ");
  TORCH_CHECK(length >= 0 && length <= cap, "length outside the buffers");
  const bool shared = prefix_keys.has_value();
  int64_t plen = 0, pcap = 0;
  const float *pk = nullptr, *pv = nullptr, *pb = nullptr;
  const int64_t* rp = nullptr;
  at::Tensor rpc, pbc;
  if (shared) {
    TORCH_CHECK(prefix_values.has_value() && prefix_bias.has_value() && row_prompt.has_value(),
                "a shared prefix needs its values, bias and row_prompt");
    check_kv(*prefix_keys, *prefix_values);
    TORCH_CHECK(prefix_keys->size(2) == d && prefix_keys->size(1) == kv_heads, "prefix shapes differ");
    pbc = prefix_bias->to(at::kFloat).contiguous();
    rpc = row_prompt->to(at::kLong).contiguous();
    plen = pbc.size(1);
    pcap = prefix_keys->size(3);
    TORCH_CHECK(plen <= pcap && pbc.size(0) == prefix_keys->size(0) && rpc.numel() == rows,
                "prefix shapes differ");
    pk = prefix_keys->data_ptr<float>();
    pv = prefix_values->data_ptr<float>();
    pb = pbc.data_ptr<float>();
    rp = rpc.data_ptr<int64_t>();
    const int64_t prompts = pbc.size(0);
    for (int64_t b = 0; b < rows; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < prompts, "row_prompt out of range");
  }
  TORCH_CHECK(plen + length >= 1, "nothing to attend to");
  at::Tensor bc;
  const float* bp = nullptr;
  int64_t bs = 0;
  if (bias.has_value()) {
    bc = bias->to(at::kFloat);
    TORCH_CHECK(bc.dim() == 2 && bc.stride(1) == 1 && bc.size(0) == rows && bc.size(1) >= length, "bias: [B, T]");
    bp = bc.data_ptr<float>();
    bs = bc.stride(0);
  }
  auto out = at::empty({rows, heads * d}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = qkv.stride(0), ss = round16(plen) + round16(length) + 16;
  const float sc = static_cast<float>(scale);
  // Tasks in row order: the rows of one group are adjacent, so their shared prompt is read from cache.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores_buf(g * ss), qf(g * d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      Segment segs[2];
      int n = 0;
      if (shared) {
        const int64_t p = rp[b];
        segs[n++] = {pk + (p * kv_heads + h) * d * pcap, pv + (p * kv_heads + h) * pcap * d, pcap, plen, pb + p * plen};
      }
      if (length > 0)
        segs[n++] = {kp + (b * kv_heads + h) * d * cap, vp + (b * kv_heads + h) * cap * d, cap, length,
                     bp ? bp + b * bs : nullptr};
      attend_group(qp + b * qs + h * g * d, static_cast<int>(g), d, segs, n, sc, op + b * heads * d + h * g * d,
                   scores_buf.data(), ss, qf.data());
    }
  });
  return out;
}

}  // namespace polyrl_native::f32
