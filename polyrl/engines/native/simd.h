// Float32 vectors for the float32 kernels (f32_kernels.cpp, linear_kernel.cpp, the sampler's fallback): one
// type, VF, of kLanes floats, on whatever the build targets. AVX-512 and AVX2 use their registers (and the exp
// torch's own vectorised kernels use, from the SLEEF library shipped with torch); anything else gets plain loops
// over 8 floats, which compilers turn into the machine's vectors (NEON on Arm). Which one is compiled follows
// the build's flags: polyrl/engines/native/__init__.py caps them with ATEN_CPU_CAPABILITY.

#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <sleef.h>
#endif

namespace polyrl_simd {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr const char* kIsa = "avx512";
struct VF {
  __m512 v;
};
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset(float x) { return {_mm512_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VF vload(const bf16* p) {  // widened: a bf16 is the high half of the float32 with its bits
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline VF vload(const int8_t* p) {  // widened: sign-extended to int32, converted exactly
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw))};
}
inline void vstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
inline VF operator+(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF operator-(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VF operator*(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF operator/(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline float vsum(VF a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxr(VF a) { return _mm512_reduce_max_ps(a.v); }
inline VF vexp(VF a) { return {Sleef_expf16_u10(a.v)}; }

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr const char* kIsa = "avx2";
struct VF {
  __m256 v;
};
inline VF vzero() { return {_mm256_setzero_ps()}; }
inline VF vset(float x) { return {_mm256_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline VF vload(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline VF vload(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))};
}
inline void vstore(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
inline VF operator+(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VF operator-(VF a, VF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VF operator*(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VF operator/(VF a, VF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vmaxr(VF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF vexp(VF a) { return {Sleef_expf8_u10avx2(a.v)}; }

#else
// Portable: fixed-size loops the compiler vectorises for the target (two NEON registers on Arm).
constexpr int kLanes = 8;
constexpr const char* kIsa = "portable";
struct VF {
  float v[8];
};
#define POLYRL_LANES for (int l = 0; l < 8; ++l)
inline VF vzero() { VF r; POLYRL_LANES r.v[l] = 0.f; return r; }
inline VF vset(float x) { VF r; POLYRL_LANES r.v[l] = x; return r; }
inline VF vload(const float* p) { VF r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline VF vload(const bf16* p) { VF r; POLYRL_LANES r.v[l] = static_cast<float>(p[l]); return r; }
inline VF vload(const int8_t* p) { VF r; POLYRL_LANES r.v[l] = static_cast<float>(p[l]); return r; }
inline void vstore(float* p, VF a) { std::memcpy(p, a.v, sizeof a.v); }
inline VF operator+(VF a, VF b) { POLYRL_LANES a.v[l] += b.v[l]; return a; }
inline VF operator-(VF a, VF b) { POLYRL_LANES a.v[l] -= b.v[l]; return a; }
inline VF operator*(VF a, VF b) { POLYRL_LANES a.v[l] *= b.v[l]; return a; }
inline VF operator/(VF a, VF b) { POLYRL_LANES a.v[l] /= b.v[l]; return a; }
inline VF vmax(VF a, VF b) { POLYRL_LANES a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return a; }
inline VF vfma(VF a, VF b, VF c) { POLYRL_LANES c.v[l] += a.v[l] * b.v[l]; return c; }
inline float vsum(VF a) {  // pairwise, like the vector reductions
  for (int w = 4; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a.v[l] += a.v[l + w];
  return a.v[0];
}
inline float vmaxr(VF a) { float m = a.v[0]; POLYRL_LANES m = a.v[l] > m ? a.v[l] : m; return m; }
inline VF vexp(VF a) { POLYRL_LANES a.v[l] = std::exp(a.v[l]); return a; }
#undef POLYRL_LANES
#endif

}  // namespace polyrl_simd
