"""Per-task gradients of one update: their norms and pairwise cosines as metrics, and PCGrad's projection.

The learner runs the batch's passes once per task (the other tasks' rows masked out; the loss is a sum over
rows with batch-wide normalisers, so the task gradients add up to the whole batch's gradient) and hands the
gradients here as flat vectors. Under a sharded learner each rank holds its shard of every parameter's
gradient: the vectors are this rank's shards, and dot products are summed over the ranks (``global_dot``),
so every rank sees the same norms, cosines and projection coefficients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Dot = Callable[[torch.Tensor, torch.Tensor], float]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def take_local_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """This rank's gradient shards of ``params`` as one float32 vector (zeros where a parameter has none);
    the parameters' gradients are cleared for the next task's passes."""
    parts = []
    for p in params:
        g = p.grad
        parts.append(_local(g).detach().flatten().float() if g is not None else _local(p).new_zeros(
            _local(p).numel(), dtype=torch.float32))
        p.grad = None
    return torch.cat(parts) if parts else torch.zeros(0)


def put_local_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write a vector made by ``take_local_grads`` back as the parameters' gradients."""
    offset = 0
    for p in params:
        n = _local(p).numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local = _local(p.grad)
        local.copy_(flat[offset : offset + n].view_as(local).to(local.dtype))
        offset += n


def global_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """a . b over the whole gradient: this rank's shards' dot product summed over the ranks."""
    d = torch.dot(a, b).double()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        d = d.to(a.device)
        dist.all_reduce(d)
    return float(d)


def pcgrad(grads: list[torch.Tensor], dot: Dot = lambda a, b: float(torch.dot(a, b)),
           order: list[list[int]] | None = None) -> torch.Tensor:
    """PCGrad (Yu et al. 2020, "Gradient Surgery for Multi-Task Learning", Algorithm 1): each task's gradient
    g_i is projected off every other task's gradient it conflicts with,

        g_i <- g_i - (g_i . g_j) / |g_j|^2 * g_j    whenever g_i . g_j < 0,

    taking the other tasks j in ``order[i]`` (the paper draws a random order; default: 0, 1, ... skipping i),
    with g_j the original gradient; the update is the sum of the projected g_i. Where no two tasks conflict
    it is the plain sum. ``dot`` is the inner product (``global_dot`` across ranks).
    """
    sq = [dot(g, g) for g in grads]
    out = torch.zeros_like(grads[0])
    for i, g in enumerate(grads):
        projected = g.clone()
        for j in order[i] if order is not None else [j for j in range(len(grads)) if j != i]:
            d = dot(projected, grads[j])
            if d < 0 and sq[j] > 0:
                projected -= d / sq[j] * grads[j]
        out += projected
    return out


def gradient_metrics(names: list[str], grads: list[torch.Tensor], dot: Dot) -> dict[str, float]:
    """``task_grad/norm/<task>`` and ``task_grad/cos/<a>/<b>`` for every pair of tasks (a before b in sorted
    order): how large each task's gradient is and whether two tasks pull the weights the same way (> 0),
    apart (0) or against each other (< 0)."""
    sq = [dot(g, g) for g in grads]
    metrics = {f"task_grad/norm/{n}": s**0.5 for n, s in zip(names, sq, strict=True)}
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            denom = (sq[i] * sq[j]) ** 0.5
            metrics[f"task_grad/cos/{names[i]}/{names[j]}"] = dot(grads[i], grads[j]) / denom if denom else 0.0
    return metrics


def combine(
    names: list[str], grads: list[torch.Tensor], surgery: str, step: int, dot: Dot = global_dot
) -> tuple[torch.Tensor, dict[str, float]]:
    """The update's gradient from the per-task ones (their sum, or PCGrad's with ``surgery`` pcgrad) and the
    per-task metrics. PCGrad's random order comes from ``step``, the same on every rank."""
    metrics = gradient_metrics(names, grads, dot)
    if surgery == "pcgrad" and len(grads) > 1:
        gen = torch.Generator().manual_seed(step)
        order = [[j for j in torch.randperm(len(grads), generator=gen).tolist() if j != i]
                 for i in range(len(grads))]
        return pcgrad(grads, dot, order), metrics
    return torch.stack(grads).sum(0), metrics
