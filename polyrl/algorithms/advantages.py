"""Advantage estimators: pure functions of per-sample rewards and group ids.

Each takes ``rewards`` (shape [N]) and ``group_ids`` (shape [N], equal ids = samples of the same prompt)
and returns one scalar advantage per sample, broadcast over its tokens by the loss.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size (scatter over ids, no Python loops)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[inverse], std[inverse], count[inverse]


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, Eq. 3 outcome supervision): A_i = (r_i - mean_g) / (std_g + eps).

    The std is the unbiased sample std of the group, as in the reference implementations.
    """
    mean, std, _ = _group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + eps)).to(rewards.dtype)
