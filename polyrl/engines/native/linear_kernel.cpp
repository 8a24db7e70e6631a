// Decode matmuls in float32 that read each weight once per call: y [B, O] = x [B, I] . W^T (+ bias), the
// weights float32 or bf16 (widened to float32 in registers, so a bf16 copy streams half the bytes), in torch's
// own [O, I] layout: no packing, so the fused decode path can read the policy's float32 weights in place.
// Weights may also be int8 with a float32 scale per output row (symmetric quantisation, engines/int8.py): each
// int8 is widened to float32 exactly, the row's float32 dot product is multiplied by its scale once at the end
// (the same value as scaling every weight first, up to float32 rounding), and a step streams a quarter of the
// float32 bytes.
//
// Why: at 16-64 rows a decode step's matmuls are bound by streaming the weights, and BLAS kernels tuned for
// large matrices reach a fraction of the machine's rate there. Each output here is a dot product of a weight row
// with an input row; a tile of MR input rows by NO weight rows keeps its MR x NO partial sums in vector
// registers, so each weight vector loaded serves MR rows and each input vector NO outputs. A thread takes a
// contiguous range of outputs and, for each block of up to kRowBlock rows, walks its weight rows once, every
// row tile of the block reading them from L1. Every output is one thread's fixed-order sum: the results do not
// depend on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using namespace polyrl_simd;

#if defined(__AVX512F__)
constexpr int kMR = 4, kNO = 6;  // 24 accumulators of 32 registers
#else
constexpr int kMR = 4, kNO = 3;  // 12 accumulators of 16 registers (AVX2); the portable loops alike
#endif
constexpr int64_t kRowBlock = 64;  // rows per pass over the weights: its inputs stay in L2

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

// y[r, o] for MR rows of ``x`` (row stride ``xs``) and the NO weight rows ``w[o]``, into ``y`` (row stride
// ``ys``), times ``scale[o]`` and plus ``bias[o]`` when given. With ``ahead`` (elements), each weight row's lines that far ahead are
// prefetched into L2 as the row is read: the rows of the group after next. The hardware prefetcher alone
// finds them late (it sees a few interleaved streams of 1-3 kB, each ending before it has learned it), and
// the tile then waits on memory where it could compute: at 16 rows that halved the matmuls' rate.
template <typename W, int MR, int NO>
void tile(const float* x, int64_t xs, const W* const* w, int64_t in, float* y, int64_t ys, const float* bias,
          const float* scale, int64_t ahead) {
  VF acc[MR][NO];
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    if (ahead && ((k * static_cast<int64_t>(sizeof(W))) & 63) == 0)
      for (int o = 0; o < NO; ++o) __builtin_prefetch(w[o] + k + ahead, 0, 2);
    VF wv[NO];
    for (int o = 0; o < NO; ++o) wv[o] = vload(w[o] + k);
    for (int r = 0; r < MR; ++r) {
      const VF xv = vload(x + r * xs + k);
      for (int o = 0; o < NO; ++o) acc[r][o] = vfma(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NO; ++o) {
      float s = vsum(acc[r][o]);
      for (int64_t j = k; j < in; ++j) s += x[r * xs + j] * widen(w[o][j]);
      if (scale) s *= scale[o];
      y[r * ys + o] = bias ? s + bias[o] : s;
    }
}

template <typename W, int NO>
void tile_rows(int mr, const float* x, int64_t xs, const W* const* w, int64_t in, float* y, int64_t ys,
               const float* bias, const float* scale, int64_t ahead) {
  switch (mr) {
    case 1: return tile<W, 1, NO>(x, xs, w, in, y, ys, bias, scale, ahead);
    case 2: return tile<W, 2, NO>(x, xs, w, in, y, ys, bias, scale, ahead);
    case 3: return tile<W, 3, NO>(x, xs, w, in, y, ys, bias, scale, ahead);
    default: return tile<W, kMR, NO>(x, xs, w, in, y, ys, bias, scale, ahead);
  }
}

template <typename W>
void tile_any(int mr, int no, const float* x, int64_t xs, const W* const* w, int64_t in, float* y, int64_t ys,
              const float* bias, const float* scale, int64_t ahead) {
  static_assert(kNO == 3 || kNO == 6, "tile_any dispatches up to 6 outputs");
  switch (no) {
    case 1: return tile_rows<W, 1>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
    case 2: return tile_rows<W, 2>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
#if defined(__AVX512F__)
    case 3: return tile_rows<W, 3>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
    case 4: return tile_rows<W, 4>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
    case 5: return tile_rows<W, 5>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
#endif
    default: return tile_rows<W, kNO>(mr, x, xs, w, in, y, ys, bias, scale, ahead);
  }
}

// The weight row of output ``o`` of the concatenated matrices.
template <typename W>
struct Rows {
  std::vector<const W*> base;
  std::vector<int64_t> stride, first;  // first output of each matrix, then the total
  const W* row(int64_t o) const {
    const int64_t m = std::upper_bound(first.begin(), first.end(), o) - first.begin() - 1;
    return base[m] + (o - first[m]) * stride[m];
  }
};

template <typename W>
void run(const at::Tensor& x, at::TensorList weights, const float* bias, const float* scale, at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), outs = y.size(1);
  Rows<W> mats;
  int64_t total = 0;
  for (const auto& t : weights) {
    mats.base.push_back(t.data_ptr<W>());
    mats.stride.push_back(t.stride(0));
    mats.first.push_back(total);
    total += t.size(0);
  }
  mats.first.push_back(total);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), groups = (outs + kNO - 1) / kNO;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const W* w[kNO];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t o0 = g * kNO;
        const int no = static_cast<int>(std::min<int64_t>(kNO, outs - o0));
        for (int o = 0; o < no; ++o) w[o] = mats.row(o0 + o);
        const float* b = bias ? bias + o0 : nullptr;
        const float* sc = scale ? scale + o0 : nullptr;
        for (int64_t r = r0; r < r1; r += kMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR, r1 - r));
          // The first row tile reads the weights from memory and prefetches those two groups on, where the
          // group's rows continue evenly spaced (one matrix; at a boundary nothing is prefetched).
          int64_t ahead = 0;
          if (r == r0 && g + 2 < end) {
            const int64_t step = mats.row(o0 + 1) - w[0];
            if (mats.row(o0 + 2 * kNO) == w[0] + 2 * kNO * step) ahead = 2 * kNO * step;
          }
          tile_any<W>(mr, no, xp + r * xs, xs, w, in, yp + r * outs + o0, outs, b, sc, ahead);
        }
      }
    }
  });
}

// x [B, I] float32 times the concatenation of ``weights`` (each [O_i, I], float32, bf16 or int8, rows
// contiguous) transposed, int8 ones times ``scale`` [sum O_i] (float32, one per output row, required for int8
// and refused otherwise), plus ``bias`` [sum O_i] (float32) when given: [B, sum O_i] in float32.
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [B, I], rows contiguous");
  TORCH_CHECK(!weights.empty(), "no weights");
  const auto wtype = weights[0].scalar_type();
  TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kChar,
              "weights must be float32, bfloat16 or int8");
  TORCH_CHECK((wtype == at::kChar) == scale.has_value(), "int8 weights need a scale per output row, others none");
  int64_t outs = 0;
  for (const auto& t : weights) {
    TORCH_CHECK(t.scalar_type() == wtype, "weights must share one dtype");
    TORCH_CHECK(t.dim() == 2 && t.size(1) == x.size(1) && t.stride(1) == 1, "weights must be [O, I], rows contiguous");
    outs += t.size(0);
  }
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == outs, "bias must have one entry per output");
  }
  at::Tensor sc;
  if (scale.has_value()) {
    sc = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(sc.numel() == outs, "scale must have one entry per output");
  }
  auto y = at::empty({x.size(0), outs}, x.options());
  if (x.size(0) == 0 || outs == 0) return y;
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const float* sp = scale.has_value() ? sc.data_ptr<float>() : nullptr;
  if (wtype == at::kFloat) run<float>(x, weights, bp, nullptr, y);
  else if (wtype == at::kBFloat16) run<bf16>(x, weights, bp, nullptr, y);
  else run<int8_t>(x, weights, bp, sp, y);
  return y;
}

// The instruction set these float32 kernels were built for: avx512, avx2 or portable.
std::string isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyrl_native, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor? bias, Tensor? scale=None) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("linear", &linear);
}
