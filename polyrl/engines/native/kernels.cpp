// The native kernels' one translation unit: each kernel file is included here, so that a build parses torch's
// headers once instead of once per file (the headers are most of a build's compile time).

#include "attention_kernel.cpp"
#include "bf16_linear.cpp"
#include "decode_kernels.cpp"
#include "f32_kernels.cpp"
#include "linear_kernel.cpp"
#include "sampling_kernels.cpp"
#include "decode_stack.cpp"
