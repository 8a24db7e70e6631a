// Fused CPU kernels for the end of a decode step: the rescored output head and inverse-CDF sampling.
//
// Why: after the bf16 output head, a decode step made about a dozen passes over its [B, 49152] logits (cast to
// float32, block maxima, two top-k searches, a gather of head rows, a batched matmul, a scatter, then the
// sampler's maximum, subtraction, exponential, block sums and two searches), 15-20 % of a step at 256 rows.
// These two kernels make two passes each, per row, with the same arithmetic (tests/test_native_kernels.py).

#include <algorithm>
#include <numeric>
#include <tuple>

#include "kernels_common.h"
#include "simd.h"

namespace {

using namespace polyrl_native;

// Float32 logits [B, V] from the bf16 head's ``low`` [B, V], with the ``k`` largest of each row recomputed in
// float32 as ``head_weight`` [V, H] . ``hidden`` [B, H]: exact where the probability mass is (the decode path's
// ``_logits``). The k largest lie in the k blocks of 64 with the largest maxima, so the search runs over those.
at::Tensor rescore_head(const at::Tensor& low, const at::Tensor& hidden, const at::Tensor& head_weight, int64_t k) {
  TORCH_CHECK(low.dtype() == at::kBFloat16 && low.dim() == 2 && low.is_contiguous(), "low must be bf16 [B, V]");
  TORCH_CHECK(head_weight.dtype() == at::kFloat && head_weight.is_contiguous(), "head_weight must be float32");
  const int64_t rows = low.size(0), vocab = low.size(1), width = head_weight.size(1);
  TORCH_CHECK(head_weight.size(0) == vocab && hidden.size(0) == rows && hidden.size(1) == width, "shapes differ");
  k = std::min(k, vocab);
  auto h = hidden.to(at::kFloat).contiguous();
  auto out = at::empty({rows, vocab}, low.options().dtype(at::kFloat));
  const bf16* lp = low.data_ptr<bf16>();
  const float* hp = h.data_ptr<float>();
  const float* wp = head_weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t block = 64;
  const bool blocked = vocab % block == 0 && vocab >= 4 * k * block;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> maxima(blocked ? vocab / block : 0);
    std::vector<int64_t> order, cand;
    for (int64_t b = begin; b < end; ++b) {
      const bf16* src = lp + b * vocab;
      float* dst = op + b * vocab;
      if (blocked) {
        for (int64_t i = 0; i < vocab / block; ++i) {
          float m = -std::numeric_limits<float>::infinity();
          int64_t j = i * block;
#ifdef __AVX512F__
          __m512 mv = _mm512_set1_ps(m);
          for (; j + 16 <= (i + 1) * block; j += 16) {
            const __m512 x = load16(src + j);
            _mm512_storeu_ps(dst + j, x);
            mv = _mm512_max_ps(mv, x);
          }
          m = _mm512_reduce_max_ps(mv);
#endif
          for (; j < (i + 1) * block; ++j) {
            dst[j] = static_cast<float>(src[j]);
            m = std::max(m, dst[j]);
          }
          maxima[i] = m;
        }
        order.resize(maxima.size());
        std::iota(order.begin(), order.end(), 0);
        std::nth_element(order.begin(), order.begin() + k - 1, order.end(),
                         [&](int64_t x, int64_t y) { return maxima[x] > maxima[y]; });
        // The k block maxima are k entries at least the k-th largest of them, so no entry below it is among
        // the k largest: only the entries of those blocks that reach it are searched (a few times k).
        const float floor = maxima[order[k - 1]];
        cand.clear();
        for (int64_t i = 0; i < k; ++i)
          for (int64_t j = order[i] * block; j < (order[i] + 1) * block; ++j)
            if (dst[j] >= floor) cand.push_back(j);
      } else {
        for (int64_t j = 0; j < vocab; ++j) dst[j] = static_cast<float>(src[j]);
        cand.resize(vocab);
        std::iota(cand.begin(), cand.end(), 0);
      }
      std::nth_element(cand.begin(), cand.begin() + k - 1, cand.end(),
                       [&](int64_t x, int64_t y) { return dst[x] > dst[y]; });
      const float* hb = hp + b * width;
      // The chosen head rows are scattered over a float32 head far larger than the caches: each is fetched
      // two rows ahead of its dot product, which otherwise waits on memory for every one of them.
      auto fetch = [&](int64_t i) {
        if (i < k)
          for (int64_t j = 0; j < width; j += 16) __builtin_prefetch(wp + cand[i] * width + j, 0, 3);
      };
      fetch(0);
      fetch(1);
      for (int64_t i = 0; i < k; ++i) {
        fetch(i + 2);
        const float* w = wp + cand[i] * width;
        float s = 0.f;
        int64_t j = 0;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= width; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(hb + j), acc);
        s = _mm512_reduce_add_ps(acc);
#endif
        for (; j < width; ++j) s += w[j] * hb[j];
        dst[cand[i]] = s;
      }
    }
  });
  return out;
}

// One token per row of ``logits`` [B, V] (float32) / ``temperature``, by inverting the CDF of
// softmax at ``u`` [B] in [0, 1): the block of 256 entries holding u * total from the blocks' sums of
// exp(x - max), then the entry within it (the engine's ``blocked_inverse_cdf``). Zero-weight entries are never
// chosen. Returns (tokens [B] int64, log-probs [B] float32).
std::tuple<at::Tensor, at::Tensor> sample_inverse_cdf(const at::Tensor& logits, const at::Tensor& u,
                                                      double temperature) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(), "logits: float32 [B, V]");
  TORCH_CHECK(temperature > 0, "temperature must be positive");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto uu = u.to(at::kFloat).contiguous().view({-1});
  TORCH_CHECK(uu.numel() == rows, "one uniform draw per row");
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({rows}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* up = uu.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const float temp = static_cast<float>(temperature);
  const bool scale = temp != 1.f;
  constexpr int64_t block = 256;
  const int64_t blocks = (vocab + block - 1) / block;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cdf(blocks), inner(block);
    for (int64_t b = begin; b < end; ++b) {
      const float* x = xp + b * vocab;
      auto at_ = [&](int64_t j) { return scale ? x[j] / temp : x[j]; };
      float m = -std::numeric_limits<float>::infinity();
      int64_t j = 0;
#ifdef __AVX512F__
      const __m512 tv = _mm512_set1_ps(temp);
      __m512 mv = _mm512_set1_ps(m);
      for (; j + 16 <= vocab; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        if (scale) v = _mm512_div_ps(v, tv);
        mv = _mm512_max_ps(mv, v);
      }
      m = _mm512_reduce_max_ps(mv);
#else  // AVX2 or the portable loops (simd.h)
      const polyrl_simd::VF tv = polyrl_simd::vset(temp);
      polyrl_simd::VF mv = polyrl_simd::vset(m);
      for (; j + polyrl_simd::kLanes <= vocab; j += polyrl_simd::kLanes) {
        polyrl_simd::VF v = polyrl_simd::vload(x + j);
        if (scale) v = v / tv;
        mv = polyrl_simd::vmax(mv, v);
      }
      m = polyrl_simd::vmaxr(mv);
#endif
      for (; j < vocab; ++j) m = std::max(m, at_(j));
      // Block sums of exp(x - max), then their running sum.
      float running = 0.f;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t lo = i * block, hi = std::min(vocab, lo + block);
        float s = 0.f;
        int64_t t = lo;
#ifdef __AVX512F__
        const __m512 mm = _mm512_set1_ps(m);
        __m512 sv = _mm512_setzero_ps();
        for (; t + 16 <= hi; t += 16) {
          __m512 v = _mm512_loadu_ps(x + t);
          if (scale) v = _mm512_div_ps(v, tv);
          sv = _mm512_add_ps(sv, Sleef_expf16_u10(_mm512_sub_ps(v, mm)));
        }
        s = _mm512_reduce_add_ps(sv);
#else
        const polyrl_simd::VF mm = polyrl_simd::vset(m);
        polyrl_simd::VF sv = polyrl_simd::vzero();
        for (; t + polyrl_simd::kLanes <= hi; t += polyrl_simd::kLanes) {
          polyrl_simd::VF v = polyrl_simd::vload(x + t);
          if (scale) v = v / tv;
          sv = sv + polyrl_simd::vexp(v - mm);
        }
        s = polyrl_simd::vsum(sv);
#endif
        for (; t < hi; ++t) s += std::exp(at_(t) - m);
        running += s;
        cdf[i] = running;
      }
      const float total = cdf[blocks - 1];
      const float target = up[b] * total;
      // The first block whose running sum exceeds the target, among blocks with weight.
      int64_t last = blocks - 1;
      while (last > 0 && !(cdf[last - 1] < total)) --last;
      int64_t i = std::upper_bound(cdf.begin(), cdf.begin() + last, target) - cdf.begin();
      const float before = i > 0 ? cdf[i - 1] : 0.f;
      const int64_t lo = i * block, n = std::min(vocab, lo + block) - lo;
      // The same exponentials as the block sums (a vector at a time from the block's start, then one by one).
      int64_t t = 0;
#ifdef __AVX512F__
      const __m512 mm = _mm512_set1_ps(m);
      for (; t + 16 <= n; t += 16) {
        __m512 v = _mm512_loadu_ps(x + lo + t);
        if (scale) v = _mm512_div_ps(v, tv);
        _mm512_storeu_ps(inner.data() + t, Sleef_expf16_u10(_mm512_sub_ps(v, mm)));
      }
#else
      const polyrl_simd::VF mm = polyrl_simd::vset(m);
      for (; t + polyrl_simd::kLanes <= n; t += polyrl_simd::kLanes) {
        polyrl_simd::VF v = polyrl_simd::vload(x + lo + t);
        if (scale) v = v / tv;
        polyrl_simd::vstore(inner.data() + t, polyrl_simd::vexp(v - mm));
      }
#endif
      for (; t < n; ++t) inner[t] = std::exp(at_(lo + t) - m);
      for (t = 1; t < n; ++t) inner[t] += inner[t - 1];
      int64_t inner_last = n - 1;
      while (inner_last > 0 && !(inner[inner_last - 1] < inner[n - 1])) --inner_last;
      const int64_t pick = std::upper_bound(inner.begin(), inner.begin() + inner_last, target - before) -
                           inner.begin();
      tp[b] = lo + pick;
      lp[b] = at_(lo + pick) - m - std::log(total);
    }
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyrl_native, m) {
  m.def("rescore_head(Tensor low, Tensor hidden, Tensor head_weight, int k) -> Tensor");
  m.def("sample_inverse_cdf(Tensor logits, Tensor u, float temperature) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polyrl_native, CPU, m) {
  m.impl("rescore_head", &rescore_head);
  m.impl("sample_inverse_cdf", &sample_inverse_cdf);
}
