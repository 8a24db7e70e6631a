// Decode matmuls in bf16 on CPUs with AVX512-BF16: y [B, O] = x [B, I] . W^T (+ bias), bf16 in and out, the
// products summed in float32 by `vdpbf16ps` and rounded to bf16 once (nearest even), as torch's bf16 linear.
//
// Why: at 16-64 rows a decode step's matmuls are bound by streaming the weights, and oneDNN's kernels, tuned
// for larger matrices, reach about half of the machine's rate there. The weights are packed once into blocks
// of 16 outputs by 2 inputs ([O/16][I/2][16][2]: one 64-byte vector per input pair), so one `vdpbf16ps` adds
// two inputs' products to 16 outputs' sums without any horizontal sum; a tile keeps up to 16 rows' sums in
// registers, each weight vector serving every row of the tile, each row's input pair broadcast from a copy of
// x interleaved the same way. A thread walks its blocks as one contiguous stream and prefetches it far ahead:
// without that the hardware prefetcher lags and the tile waits on memory. Every output is one thread's
// fixed-order sum, so the results do not depend on the thread count.

#include <memory>

#include "kernels_common.h"

namespace polyrl_native {
namespace {

#if defined(__AVX512BF16__)
constexpr bool kBf16Linear = true;
constexpr int64_t kBlock = 16;             // outputs per block: one vector of float32 sums
constexpr int64_t kAhead = 16384 / 64;     // prefetch distance, in 64-byte weight vectors (16 kB)

// MR rows (their input pairs interleaved: xt[p * MR + r]) by one block of 16 outputs, over ``pairs`` input
// pairs, into bf16 ``y`` (row stride ``ys``; ``valid`` outputs of the 16 written), plus ``bias`` when given.
template <int MR>
void tile(const int32_t* xt, const __m512i* w, int64_t pairs, bf16* y, int64_t ys, int valid, const float* bias,
          bool prefetch) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + p + kAhead), _MM_HINT_T0);
    const __m512bh wv = (__m512bh)_mm512_load_si512(w + p);
    const int32_t* xp = xt + p * MR;
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xp[r]), wv);
  }
  const __mmask16 mask = valid == kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) {
    const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(_mm512_add_ps(acc[r], b)), 16));
    _mm256_mask_storeu_epi16(y + r * ys, mask, bits);
  }
}

// dst[p * mr + r] = the input pair (2 p, 2 p + 1) of row r of ``x`` (row stride ``xs``, ``in`` inputs, the
// last pair zero-padded when ``in`` is odd): a transpose of [mr, pairs] 32-bit pairs, 16 x 16 at a time for
// full tiles.
void interleave(const uint16_t* x, int64_t xs, int64_t in, int mr, int32_t* dst) {
  const int64_t pairs = (in + 1) / 2, whole = in / 2;
  int64_t p0 = 0;
  if (mr == 16 && xs % 2 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0) {
    const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
    for (; p0 + 16 <= whole; p0 += 16) {
      __m512i v[16], t[16], out[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(x32 + r * (xs / 2) + p0);
      for (int r = 0; r < 16; r += 2) {  // per 128-bit lane: rows r, r + 1 interleaved
        t[r] = _mm512_unpacklo_epi32(v[r], v[r + 1]);
        t[r + 1] = _mm512_unpackhi_epi32(v[r], v[r + 1]);
      }
      for (int g = 0; g < 16; g += 4) {  // v[g + j], lane l: column 4 l + j of rows g .. g + 3
        v[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        v[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        v[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        v[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
      }
      for (int j = 0; j < 4; ++j) {  // column 4 l + j: lane l of v[j], v[4 + j], v[8 + j], v[12 + j]
        const __m512i lo_a = _mm512_shuffle_i32x4(v[j], v[4 + j], 0x44);
        const __m512i lo_b = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0x44);
        const __m512i hi_a = _mm512_shuffle_i32x4(v[j], v[4 + j], 0xEE);
        const __m512i hi_b = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0xEE);
        out[j] = _mm512_shuffle_i32x4(lo_a, lo_b, 0x88);
        out[4 + j] = _mm512_shuffle_i32x4(lo_a, lo_b, 0xDD);
        out[8 + j] = _mm512_shuffle_i32x4(hi_a, hi_b, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(hi_a, hi_b, 0xDD);
      }
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(dst + (p0 + q) * 16, out[q]);
    }
  }
  for (int r = 0; r < mr; ++r) {
    const uint16_t* row = x + r * xs;
    for (int64_t p = p0; p < pairs; ++p) {
      const uint32_t hi = 2 * p + 1 < in ? row[2 * p + 1] : 0;
      dst[p * mr + r] = static_cast<int32_t>(row[2 * p] | (hi << 16));
    }
  }
}

void tile_rows(int mr, const int32_t* xt, const __m512i* w, int64_t pairs, bf16* y, int64_t ys, int valid,
               const float* bias, bool prefetch) {
  switch (mr) {
    case 16: return tile<16>(xt, w, pairs, y, ys, valid, bias, prefetch);
    case 8: return tile<8>(xt, w, pairs, y, ys, valid, bias, prefetch);
    case 4: return tile<4>(xt, w, pairs, y, ys, valid, bias, prefetch);
    case 2: return tile<2>(xt, w, pairs, y, ys, valid, bias, prefetch);
    default: return tile<1>(xt, w, pairs, y, ys, valid, bias, prefetch);
  }
}
#else
constexpr bool kBf16Linear = false;
#endif

void check_packable(const at::Tensor& weight) {
  TORCH_CHECK(kBf16Linear, "the bf16 linear kernel needs a build for a CPU with AVX512-BF16");
  check_bf16_2d(weight, "weight");
}

// A bf16 [O, I] weight packed for ``bf16_linear``: [ceil(O/16), ceil(I/2), 16, 2], zero-padded. A block of 16
// whole rows is the transpose of their 32-bit input pairs, as ``interleave`` lays out x: one pass, in parallel
// (the engine packs every matrix at each weight sync).
at::Tensor bf16_pack(const at::Tensor& weight) {
  check_packable(weight);
  const int64_t outs = weight.size(0), in = weight.size(1), pairs = (in + 1) / 2, blocks = (outs + 15) / 16;
  auto packed = at::empty({blocks, pairs, 16, 2}, weight.options());
#if defined(__AVX512BF16__)
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<bf16>());
  int32_t* dst = reinterpret_cast<int32_t*>(packed.data_ptr<bf16>());
  const int64_t ws = weight.stride(0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> padded;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t rows = std::min<int64_t>(16, outs - b * 16);
      if (rows == 16) {
        interleave(w + b * 16 * ws, ws, in, 16, dst + b * pairs * 16);
      } else {  // the last, partial block: its rows copied beside zero rows
        padded.assign(16 * in, 0);
        for (int64_t r = 0; r < rows; ++r) {
          const uint16_t* row = w + (b * 16 + r) * ws;
          std::copy(row, row + in, &padded[r * in]);
        }
        interleave(padded.data(), in, in, 16, dst + b * pairs * 16);
      }
    }
  });
#endif
  return packed;
}

// x [B, I] bf16 times the packed weight of ``outs`` outputs, plus ``bias`` [outs] when given: [B, outs] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t outs,
                       const c10::optional<at::Tensor>& bias) {
  check_bf16_2d(x, "x");
  TORCH_CHECK(packed.dtype() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed must be a contiguous, 64-byte aligned bf16_pack result");
  const int64_t rows = x.size(0), in = x.size(1), pairs = packed.size(1);
  TORCH_CHECK(pairs == (in + 1) / 2, "x has ", in, " inputs, the packed weight ", 2 * pairs);
  TORCH_CHECK(outs > 0 && (outs + 15) / 16 == packed.size(0), "outs does not match the packed weight");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == outs, "bias must have one entry per output");
  }
  auto y = at::empty({rows, outs}, x.options());
#if defined(__AVX512BF16__)
  if (rows == 0) return y;
  // Rows in tiles of 16, then 8, 4, 2, 1; each tile's input pairs interleaved ([pairs][tile rows]) so that a
  // row's pair is one 32-bit broadcast at a fixed offset, the last pair zero-padded when I is odd.
  std::vector<int64_t> first, size;
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r, mr = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    first.push_back(r);
    size.push_back(mr);
    r += mr;
  }
  std::unique_ptr<int32_t[]> xt(new int32_t[rows * pairs]);  // every entry written below: no zero fill
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  for (size_t t = 0; t < first.size(); ++t)
    interleave(xs + first[t] * x.stride(0), x.stride(0), in, static_cast<int>(size[t]),
               xt.get() + first[t] * pairs);
  const __m512i* w = reinterpret_cast<const __m512i*>(packed.data_ptr<bf16>());
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int valid = static_cast<int>(std::min<int64_t>(kBlock, outs - blk * kBlock));
      for (size_t t = 0; t < first.size(); ++t)  // the first tile streams the block, the others read L1
        tile_rows(static_cast<int>(size[t]), xt.get() + first[t] * pairs, w + blk * pairs, pairs,
                  yp + first[t] * outs + blk * kBlock, outs, valid, bp ? bp + blk * kBlock : nullptr, t == 0);
    }
  });
#endif
  return y;
}

bool bf16_linear_available() { return kBf16Linear; }

}  // namespace
}  // namespace polyrl_native

TORCH_LIBRARY_FRAGMENT(polyrl_native, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int outs, Tensor? bias=None) -> Tensor");
  m.def("bf16_linear_available() -> bool", &polyrl_native::bf16_linear_available);
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("bf16_pack", &polyrl_native::bf16_pack);
  m.impl("bf16_linear", &polyrl_native::bf16_linear);
}
