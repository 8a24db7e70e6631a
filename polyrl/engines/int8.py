"""Weight-only int8 for the fused decode path (``engine.int8_weights``).

Each [out, in] matrix is quantised symmetrically per output row: ``scale = max|w_row| / 127`` and
``q = round(w / scale)`` in [-127, 127], so every element is off by at most ``scale / 2``. The native ``linear``
reads the int8 rows, widens them to float32 in registers and multiplies each row's dot product by its scale: a
decode step, which streams every weight once, reads a quarter of the float32 bytes. Activations, norms,
attention and the sampled distribution stay float32; only the matrices are rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weights:
    """One matmul's matrices (outputs concatenated) in int8, with the float32 scale of each output row."""

    q: torch.Tensor
    """int8 [out, in], rows contiguous."""
    scale: torch.Tensor
    """float32 [out]."""

    def dequantise(self) -> torch.Tensor:
        """The float32 [out, in] matrix these int8 rows stand for."""
        return self.q.float() * self.scale[:, None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


@torch.no_grad()
def quantise_int8(weight: torch.Tensor) -> Int8Weights:
    """Symmetric per-output-row int8 of a 2-D ``weight`` (any float dtype). An all-zero row gets scale 1 and
    zeros, so it stays exact."""
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"quantise_int8: expected an [out, in] matrix, got shape {tuple(w.shape)}")
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weights(q, scale.contiguous())


def tensors_of(weights) -> list[torch.Tensor]:
    """The tensors a matmul's weights hold (none for None), to count their bytes: a tensor, a list of them, or
    packed weights that list their own (``tensors()``)."""
    if weights is None:
        return []
    if hasattr(weights, "tensors"):
        return weights.tensors()
    return list(weights) if isinstance(weights, list) else [weights]
