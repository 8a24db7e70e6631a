// Shared by the native kernels (polyrl/engines/native/*.cpp): bf16 <-> float32 conversions with torch's
// rounding, 16 lanes at a time where the CPU has AVX-512, and argument checks.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#include <sleef.h>  // shipped with torch; the exp torch's own vectorised kernels use
#endif

namespace polyrl_native {

using bf16 = c10::BFloat16;

inline float f(bf16 x) { return static_cast<float>(x); }
inline bf16 r(float x) { return bf16(x); }  // round to nearest even, as torch's casts

#ifdef __AVX512F__
// 16 lanes at a time: bf16 <-> float32 conversions with torch's rounding (nearest even), and exp.
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512i round_bits(__m512 v) {  // float bits rounded to nearest-even bf16, kept in the high half
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
inline __m512 rnd16(__m512 v) {  // v rounded to bf16, as float32
  return _mm512_castsi512_ps(_mm512_and_si512(round_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16)));
}
#endif

inline void check_bf16_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace polyrl_native
