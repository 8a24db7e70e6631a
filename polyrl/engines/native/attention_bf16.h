// The bf16 attention's scores and value sums on `vdpbf16ps` (CPUs with AVX512-BF16), for attention_kernel.cpp.
//
// Why: a decode step's attention has few query heads per key/value head (3 in SmolLM2), so widening every key
// and value to float32 before its multiply-adds costs as much as the multiply-adds themselves. `vdpbf16ps` takes
// the bf16 keys and values as they are stored and adds two exact products per lane to a float32 sum: two rows
// of the stored layout (two key dimensions, or two value positions) are interleaved in registers
// (`vpunpck*wd`), which leaves the sums in a fixed lane order that is put back once, when they are stored.
// The products are those of the float32 path (bf16 x bf16 is exact in float32); only the order of the float32
// sums differs.

#pragma once

#include <cstring>

#include "kernels_common.h"
#include "attention_common.h"

namespace polyrl_native {

using Segment = KVSegment<bf16>;

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
constexpr bool kBf16Attention = true;

inline uint32_t bf16_pair(const bf16* p) {  // elements p[0] (low half) and p[1] (high half), as one lane
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

// After `unpacklo/hi_epi16` of two 32-element rows, lane k of ``lo`` holds element 8 (k / 4) + k % 4 and lane k
// of ``hi`` element 8 (k / 4) + 4 + k % 4; ``first`` and ``second`` get elements 0-15 and 16-31 in order.
inline void in_order(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  first = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  second =
      _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}

// Scores (q . k) x scale of G query heads (bf16 rows of ``d`` at ``q``) for the segment's positions, 32 and then
// 16 at a time, into ``scores`` (row stride ``ss``); each dimension pair of the transposed keys is interleaved
// into position-major lanes. Positions up to the next multiple of 16 lie inside the buffer (its capacity is a
// multiple of 16); their scores past ``length`` land in the caller's slack. Returns the first position not
// computed.
template <int G>
int64_t scores_bf16_g(const bf16* q, int64_t d, const Segment& seg, float scale, float* scores, int64_t ss) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t t0 = 0;
  for (; t0 + 32 <= seg.cap && t0 + 16 < seg.length; t0 += 32) {
    __m512 lo[G], hi[G];
    for (int i = 0; i < G; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 2) {
      const __m512i x = _mm512_loadu_si512(seg.kt + j * seg.cap + t0);
      const __m512i y = _mm512_loadu_si512(seg.kt + (j + 1) * seg.cap + t0);
      const __m512bh kl = (__m512bh)_mm512_unpacklo_epi16(x, y), kh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int i = 0; i < G; ++i) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(q + i * d + j)));
        lo[i] = _mm512_dpbf16_ps(lo[i], kl, qv);
        hi[i] = _mm512_dpbf16_ps(hi[i], kh, qv);
      }
    }
    for (int i = 0; i < G; ++i) {
      __m512 first, second;
      in_order(lo[i], hi[i], first, second);
      _mm512_storeu_ps(scores + i * ss + t0, _mm512_mul_ps(first, sv));
      _mm512_storeu_ps(scores + i * ss + t0 + 16, _mm512_mul_ps(second, sv));
    }
  }
  const __m256i first8 = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
  const __m256i second8 = _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15);
  for (; t0 + 16 <= seg.cap && t0 < seg.length; t0 += 16) {
    __m256 lo[G], hi[G];
    for (int i = 0; i < G; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 2) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(seg.kt + j * seg.cap + t0));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(seg.kt + (j + 1) * seg.cap + t0));
      const __m256bh kl = (__m256bh)_mm256_unpacklo_epi16(x, y), kh = (__m256bh)_mm256_unpackhi_epi16(x, y);
      for (int i = 0; i < G; ++i) {
        const __m256bh qv = (__m256bh)_mm256_set1_epi32(static_cast<int>(bf16_pair(q + i * d + j)));
        lo[i] = _mm256_dpbf16_ps(lo[i], kl, qv);
        hi[i] = _mm256_dpbf16_ps(hi[i], kh, qv);
      }
    }
    const __m256 s8 = _mm256_set1_ps(scale);
    for (int i = 0; i < G; ++i) {
      _mm256_storeu_ps(scores + i * ss + t0, _mm256_mul_ps(_mm256_permutex2var_ps(lo[i], first8, hi[i]), s8));
      _mm256_storeu_ps(scores + i * ss + t0 + 8, _mm256_mul_ps(_mm256_permutex2var_ps(lo[i], second8, hi[i]), s8));
    }
  }
  return t0;
}

inline int64_t scores_bf16(int g, const bf16* q, int64_t d, const Segment& seg, float scale, float* scores,
                           int64_t ss) {
  return with_heads(g, [&](auto G) { return scores_bf16_g<decltype(G)::value>(q, d, seg, scale, scores, ss); });
}

// out[i] = sum over the segments' positions t of p[i, t] v[t] for G heads and head_dim NC * 32, two positions a
// step: their value rows interleaved, their probabilities (already bf16) one bf16 pair. ``p`` holds the
// segments' probabilities one after another (row stride ``ss``); an odd segment's last pair has a zero second
// half (its value row is not read: past ``length`` it may be anything).
template <int G, int NC>
void weigh_values_bf16_g(const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  constexpr int64_t d = NC * 32;
  __m512 acc[G][2 * NC];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < 2 * NC; ++c) acc[i][c] = _mm512_setzero_ps();
  int64_t off = 0;
  for (int k = 0; k < n; ++k) {
    const bf16* v = segs[k].v;
    const int64_t length = segs[k].length;
    for (int64_t t = 0; t < length; t += 2) {
      const bool pair = t + 1 < length;
      __m512bh vl[NC], vh[NC];
      for (int c = 0; c < NC; ++c) {
        const __m512i a = _mm512_loadu_si512(v + t * d + c * 32);
        const __m512i b = pair ? _mm512_loadu_si512(v + (t + 1) * d + c * 32) : _mm512_setzero_si512();
        vl[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        vh[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int i = 0; i < G; ++i) {
        uint32_t p0, p1 = 0;
        std::memcpy(&p0, p + i * ss + off + t, sizeof p0);
        if (pair) std::memcpy(&p1, p + i * ss + off + t + 1, sizeof p1);
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>((p0 >> 16) | (p1 & 0xFFFF0000u)));
        for (int c = 0; c < NC; ++c) {
          acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], vl[c], pv);
          acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], vh[c], pv);
        }
      }
    }
    off += length;
  }
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NC; ++c) {
      __m512 first, second;
      in_order(acc[i][2 * c], acc[i][2 * c + 1], first, second);
      store16(out + i * d + c * 32, first);
      store16(out + i * d + c * 32 + 16, second);
    }
}

// The same for any g: heads in chunks small enough for their sums to stay in registers (16 vectors).
template <int NC>
void weigh_values_bf16_nc(int g, const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  constexpr int chunk = 8 / NC;  // 4 heads at head_dim 64, 2 at 128
  for (int h = 0; h < g; h += chunk) {
    const float* ph = p + h * ss;
    bf16* oh = out + h * NC * 32;
    const int left = g - h < chunk ? g - h : chunk;
    if (left == chunk) weigh_values_bf16_g<chunk, NC>(ph, ss, segs, n, oh);
    else if (left == 1) weigh_values_bf16_g<1, NC>(ph, ss, segs, n, oh);
    else if (left == 2) weigh_values_bf16_g<2, NC>(ph, ss, segs, n, oh);
    else weigh_values_bf16_g<3, NC>(ph, ss, segs, n, oh);
  }
}

inline void weigh_values_bf16(int g, int64_t d, const float* p, int64_t ss, const Segment* segs, int n, bf16* out) {
  if (d == 64) weigh_values_bf16_nc<2>(g, p, ss, segs, n, out);
  else weigh_values_bf16_nc<4>(g, p, ss, segs, n, out);
}
#else
constexpr bool kBf16Attention = false;
#endif

}  // namespace polyrl_native
