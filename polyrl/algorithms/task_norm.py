"""Task-advantage normalisation for multi-task batches: a pure function of advantages and task ids."""

from __future__ import annotations

import torch


def task_normalise(advantages: torch.Tensor, task_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Task-advantage normalisation (Zhang et al. 2025, "AgentRL: Scaling Agentic Reinforcement Learning with
    a Multi-Turn, Multi-Task Framework", task advantage normalisation): within each task of the batch,

        A_i <- (A_i - mean_task(A)) / (std_task(A) + eps)     (population std over the task's samples).

    Tasks differ in reward scale and in how many of their groups carry signal, so without this one task's
    large advantages dominate the shared gradient. A task whose advantages are all equal (e.g. every group
    solved) keeps advantages of 0. ``advantages`` and ``task_ids`` are [N]; returns [N] in the input dtype.
    """
    if advantages.dim() != 1 or advantages.shape != task_ids.shape:
        raise ValueError(f"task_normalise: advantages {tuple(advantages.shape)} and task ids "
                         f"{tuple(task_ids.shape)} must both be [N]")
    if advantages.numel() == 0:
        return advantages
    _, inverse = torch.unique(task_ids, return_inverse=True)
    k = int(inverse.max()) + 1
    a = advantages.double()
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(a))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, a) / count
    centred = a - mean[inverse]
    var = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
    std = var.sqrt()[inverse]
    # A constant task is centred to exact zeros; dividing them is skipped so eps = 0 stays well defined.
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred)).to(advantages.dtype)
