// What the bf16 and float32 attention kernels share (attention_kernel.cpp, attention_bf16.h, f32_kernels.cpp).

#pragma once

#include <cstdint>
#include <type_traits>

namespace polyrl_native {

// A stretch of keys and values one query attends to: ``kt`` [d, cap] (transposed keys), ``v`` [cap, d], its
// first ``length`` positions, and ``bias`` (0 or -inf per position) or none (all visible). A row's attention
// may span two: the prompt its group shares, stored once, and its own generated positions.
template <typename T>
struct KVSegment {
  const T* kt;
  const T* v;
  int64_t cap;
  int64_t length;
  const float* bias;
};

// A runtime head count as a compile-time one, for the kernels written per head count (their per-head sums
// then stay in registers):
// f(std::integral_constant<int, G>{}) with G = g for g in 1..8, and 8 above that (callers check g <= 8).
template <typename F>
decltype(auto) with_heads(int g, F&& f) {
  switch (g) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

}  // namespace polyrl_native
