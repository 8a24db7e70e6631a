"""The bf16 decode path's matmuls on a CPU: each weight packed once, then ``linear`` on the packed copy.

Two packings, both giving ``F.linear``'s result up to the order of its float32 sums:

- polyrl's own (``engines/native/bf16_linear.cpp``) where the native kernels are built for AVX512-BF16 and the
  CPU has no AMX: blocks of 16 outputs by 2 inputs for ``vdpbf16ps``, streamed once per call with a far
  prefetch. At the 16-64 rows of a decode step it runs the matmuls well above oneDNN's rate there.
- oneDNN's blocked layout (the op torch.compile emits for CPU linears) elsewhere: with AMX, whose tiles oneDNN
  drives, and where the native kernels are off or not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.engines import native

PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; any row count still works


def packing_available() -> bool:
    """True when this torch build can prepack bfloat16 linear weights for oneDNN (x86 CPUs with AVX-512)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def native_bf16_linear_available() -> bool:
    """True when polyrl's own bf16 matmul runs here: the native kernels built for AVX512-BF16, no AMX."""
    if not native.available() or not native.ops().bf16_linear_available():
        return False
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return not (amx is not None and amx())


@dataclass
class NativeBf16Weights:
    """A bf16 [out, in] matrix packed for the native kernel: [ceil(out/16), ceil(in/2), 16, 2]."""

    blocks: torch.Tensor
    outs: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]


def pack(weight: torch.Tensor, native_kernel: bool) -> torch.Tensor | NativeBf16Weights:
    """A bf16 ``[out, in]`` weight packed for ``packed_linear``: for the native kernel, or oneDNN's layout."""
    if native_kernel:
        return NativeBf16Weights(native.ops().bf16_pack(weight.contiguous()), weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor | NativeBf16Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` of 2-D bf16 ``x`` on a packed weight."""
    if isinstance(weight, NativeBf16Weights):
        return native.ops().bf16_linear(x.contiguous(), weight.blocks, weight.outs, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
