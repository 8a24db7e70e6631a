// One-position attention for the fused decode path's native kernels: a row's query against its group's
// shared prompt and its own generated positions, one softmax over both (polyrl/engines/decode_kv.py,
// PromptSharedKV). Same roundings as the torch attention it replaces (tests/test_native_kernels.py).

#include "attention_bf16.h"
#include "f32_kernels.h"
#include "attention_common.h"
#include "kernels_common.h"

namespace {

using namespace polyrl_native;

// Softmax of each of the g score rows (``stride`` apart, ``length`` used) in place, the probabilities
// rounded to bf16 (as SDPA rounds them before they weight bf16 values). Masked scores are -inf. The last
// partial vector of a row is masked rather than done one score at a time: a scalar exp costs as much as a
// vector one.
void softmax_rows(float* scores, int g, int64_t stride, int64_t length) {
  for (int i = 0; i < g; ++i) {
    float* s = scores + i * stride;
#ifdef __AVX512F__
    auto lanes = [length](int64_t t) {
      return length - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (length - t)) - 1);
    };
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < length; t += 16)
      mv = _mm512_mask_max_ps(mv, lanes(t), mv, _mm512_maskz_loadu_ps(lanes(t), s + t));
    const __m512 mm = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes(t), s + t), mm));
      _mm512_mask_storeu_ps(s + t, lanes(t), e);
      sv = _mm512_mask_add_ps(sv, lanes(t), sv, e);
    }
    const __m512 iv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
    for (int64_t t = 0; t < length; t += 16)
      _mm512_mask_storeu_ps(s + t, lanes(t), rnd16(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(t), s + t), iv)));
#else
    float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t t = 0; t < length; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < length; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < length; ++t) s[t] = f(r(s[t] * inv));
#endif
  }
}

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

#ifdef __AVX512F__
// Scores of G query heads sixteen keys at a time into ``scores`` (row stride ``ss``): each key dimension j is
// one 16-wide load of the transposed keys, broadcast-multiplied by query j of each head (G fixed at compile
// time keeps the accumulators in registers). Positions up to the next multiple of 16 lie inside the buffer
// (its capacity is a multiple of 16); their scores past ``length`` land in the caller's slack. Returns the
// first position not computed.
// Thirty-two keys at a time where two blocks are needed: each score is still one sum over j in order, but
// the 2 G accumulators hide the multiply-add latency that G alone (3 in SmolLM2) leaves exposed.
template <int G>
int64_t scores16_g(const float* qf, int64_t d, const Segment& seg, float* scores, int64_t ss) {
  int64_t t0 = 0;
  for (; t0 + 32 <= seg.cap && t0 + 16 < seg.length; t0 += 32) {
    __m512 acc[G][2];
    for (int i = 0; i < G; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j) {
      const __m512 k0 = load16(seg.kt + j * seg.cap + t0), k1 = load16(seg.kt + j * seg.cap + t0 + 16);
      for (int i = 0; i < G; ++i) {
        const __m512 qv = _mm512_set1_ps(qf[i * d + j]);
        acc[i][0] = _mm512_fmadd_ps(qv, k0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(qv, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < G; ++i) {
      _mm512_storeu_ps(scores + i * ss + t0, acc[i][0]);
      _mm512_storeu_ps(scores + i * ss + t0 + 16, acc[i][1]);
    }
  }
  for (; t0 + 16 <= seg.cap && t0 < seg.length; t0 += 16) {
    __m512 acc[G];
    for (int i = 0; i < G; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j) {
      const __m512 kj = load16(seg.kt + j * seg.cap + t0);
      for (int i = 0; i < G; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[i * d + j]), kj, acc[i]);
    }
    for (int i = 0; i < G; ++i) _mm512_storeu_ps(scores + i * ss + t0, acc[i]);
  }
  return t0;
}

int64_t scores16(int g, const float* qf, int64_t d, const Segment& seg, float* scores, int64_t ss) {
  return with_heads(g, [&](auto G) { return scores16_g<decltype(G)::value>(qf, d, seg, scores, ss); });
}

// out[i] = sum over the segments' positions t of p[i, t] v[t], for G heads and head_dim NV * 16, the sums in
// registers; ``p`` holds the segments' probabilities one after another (row stride ``ss``).
template <int G, int NV>
void weigh_values_g(const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  __m512 acc[G][NV];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  int64_t off = 0;
  for (int k = 0; k < n; ++k) {
    for (int64_t t = 0; t < segs[k].length; ++t) {
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = load16(segs[k].v + t * NV * 16 + c * 16);
      for (int i = 0; i < G; ++i) {
        const __m512 pv = _mm512_set1_ps(p[i * ss + off + t]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(pv, vv[c], acc[i][c]);
      }
    }
    off += segs[k].length;
  }
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NV; ++c) store16(out + (i * NV + c) * 16, acc[i][c]);
}

template <int NV>
void weigh_values_nv(int g, const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  return with_heads(g, [&](auto G) { return weigh_values_g<decltype(G)::value, NV>(p, ss, segs, n, out); });
}

// The vectorised weighting for head_dim 64 or 128; false for other widths (the caller's loop does them).
bool weigh_values(int g, int64_t d, const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  if (d == 64) weigh_values_nv<4>(g, p, ss, segs, n, out);
  else if (d == 128) weigh_values_nv<8>(g, p, ss, segs, n, out);
  else return false;
  return true;
}
#endif

// Scores and softmax for g query heads over ``n`` segments into ``scores`` (row stride ``ss``, at least the
// segments' lengths rounded up to 16 each, plus 16), then the weighted values: one query position's attention.
// Scores and softmax in float32 (bf16 keys are exact in float32), probabilities rounded to bf16 as SDPA
// rounds them, the output rounded to bf16 once. With AVX512-BF16 and head_dim a multiple of 32 up to 128 the
// scores (q . k) x scale and the weighted values run on `vdpbf16ps` (attention_bf16.h); otherwise on the
// queries scaled and widened to float32 (``qf``).
void attend_group(const bf16* q, int g, int64_t d, const Segment* segs, int n, float scale, bf16* out,
                  float* scores, int64_t ss, float* qf, float* acc) {
  const bool dot_bf16 = kBf16Attention && d % 32 == 0 && d <= 128;
  if (!dot_bf16)
    for (int i = 0; i < g; ++i)
      for (int64_t j = 0; j < d; ++j) qf[i * d + j] = f(q[i * d + j]) * scale;
  int64_t off = 0;
  for (int k = 0; k < n; ++k) {
    const Segment& seg = segs[k];
    float* sc = scores + off;
    int64_t t0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if (dot_bf16) t0 = scores_bf16(g, q, d, seg, scale, sc, ss);
    else
#endif
#ifdef __AVX512F__
      t0 = scores16(g, qf, d, seg, sc, ss);
#endif
    for (int64_t t = t0; t < seg.length; ++t)
      for (int i = 0; i < g; ++i) {
        float s = 0.f;
        for (int64_t j = 0; j < d; ++j)
          s += (dot_bf16 ? f(q[i * d + j]) : qf[i * d + j]) * f(seg.kt[j * seg.cap + t]);
        sc[i * ss + t] = dot_bf16 ? s * scale : s;
      }
    if (seg.bias)
      for (int i = 0; i < g; ++i)
        for (int64_t t = 0; t < seg.length; ++t) sc[i * ss + t] += seg.bias[t];
    off += seg.length;
  }
  softmax_rows(scores, g, ss, off);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if (dot_bf16) return weigh_values_bf16(g, d, scores, ss, segs, n, out);
#endif
#ifdef __AVX512F__
  if (weigh_values(g, d, scores, ss, segs, n, out)) return;
#endif
  for (int64_t j = 0; j < g * d; ++j) acc[j] = 0.f;
  off = 0;
  for (int k = 0; k < n; ++k) {
    for (int64_t t = 0; t < segs[k].length; ++t) {
      const bf16* vt = segs[k].v + t * d;
      for (int i = 0; i < g; ++i) {
        const float p = scores[i * ss + off + t];
        for (int64_t j = 0; j < d; ++j) acc[i * d + j] += p * f(vt[j]);
      }
    }
    off += segs[k].length;
  }
  for (int64_t j = 0; j < g * d; ++j) out[j] = r(acc[j]);
}

void check_kv(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dtype() == at::kBFloat16 && values.dtype() == at::kBFloat16, "keys and values must be bf16");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys and values must be contiguous");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(2) == values.size(3) &&
                  keys.size(3) == values.size(2) && keys.size(1) == values.size(1),
              "keys must be [B, kv_heads, head_dim, capacity] and values [B, kv_heads, capacity, head_dim]");
}

// Attention of one query position per row (grouped-query: query head h reads key/value head
// h / (heads / kv_heads)) over the first ``length`` positions of its own buffers (keys [B, kv_heads, d, cap],
// values [B, kv_heads, cap, d]) and, with ``prefix_keys``, first over the prompt its group shares: prompt
// ``row_prompt[b]`` of ``prefix_keys`` [P, kv_heads, d, Tcap] / ``prefix_values`` [P, kv_heads, Tcap, d], the
// first ``prefix_bias.size(1)`` positions, masked by ``prefix_bias`` [P, T] (0 or -inf: left padding). ``bias``
// [B, >= length] masks the row's own positions, or none. Returns [B, heads * d] in bf16, the layout the output
// projection reads.
at::Tensor attention(const at::Tensor& qkv, const c10::optional<at::Tensor>& prefix_keys,
                     const c10::optional<at::Tensor>& prefix_values, const c10::optional<at::Tensor>& prefix_bias,
                     const c10::optional<at::Tensor>& row_prompt, const at::Tensor& keys, const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias, int64_t length, double scale, int64_t heads,
                     int64_t kv_heads) {
  if (qkv.scalar_type() == at::kFloat)  // the float32 path (f32_kernels.cpp)
    return f32::attention(qkv, prefix_keys, prefix_values, prefix_bias, row_prompt, keys, values, bias, length, scale,
                          heads, kv_heads);
  check_bf16_2d(qkv, "qkv");
  check_kv(keys, values);
  const int64_t rows = qkv.size(0), d = values.size(3), cap = values.size(2);
  const int64_t g = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && g <= 8, "at most 8 query heads per key/value head");
  TORCH_CHECK(qkv.size(1) >= heads * d && keys.size(0) == rows && keys.size(1) == kv_heads, "shapes differ");
  TORCH_CHECK(length >= 0 && length <= cap, "length outside the buffers");
  const bool shared = prefix_keys.has_value();
  int64_t plen = 0, pcap = 0;
  const bf16 *pk = nullptr, *pv = nullptr;
  const float* pb = nullptr;
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
    TORCH_CHECK(plen <= pcap && pbc.size(0) == prefix_keys->size(0) && rpc.numel() == rows, "prefix shapes differ");
    pk = prefix_keys->data_ptr<bf16>();
    pv = prefix_values->data_ptr<bf16>();
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
  const bf16* qp = qkv.data_ptr<bf16>();
  const bf16* kp = keys.data_ptr<bf16>();
  const bf16* vp = values.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t qs = qkv.stride(0), ss = round16(plen) + round16(length) + 16;
  const float sc = static_cast<float>(scale);
  // Tasks in row order: the rows of one group are adjacent, so their shared prompt is read from cache.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * ss), qf(g * d), acc(g * d);
    constexpr int64_t ahead = 2;  // tasks ahead: the next rows' keys and values are fetched while this one computes
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      if (task + ahead < end && length > 0) {
        const int64_t nb = (task + ahead) / kv_heads, nh = (task + ahead) % kv_heads;
        const char* kn = reinterpret_cast<const char*>(kp + (nb * kv_heads + nh) * d * cap);
        const char* vn = reinterpret_cast<const char*>(vp + (nb * kv_heads + nh) * cap * d);
        for (int64_t j = 0; j < d; ++j)
          for (int64_t t = 0; t < 2 * length; t += 64) _mm_prefetch(kn + 2 * j * cap + t, _MM_HINT_T0);
        for (int64_t t = 0; t < 2 * length * d; t += 64) _mm_prefetch(vn + t, _MM_HINT_T0);
      }
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
                   scores.data(), ss, qf.data(), acc.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyrl_native, m) {
  m.def("attention(Tensor qkv, Tensor? prefix_keys, Tensor? prefix_values, Tensor? prefix_bias, "
        "Tensor? row_prompt, Tensor keys, Tensor values, Tensor? bias, int length, float scale, int heads, "
        "int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("attention", &attention);
}
