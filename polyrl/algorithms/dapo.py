"""DAPO's sampling and reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale") as pure functions; clip-higher is ``loss.clip_high`` in every loss and token-mean is ``loss.agg``."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """Soft overlong punishment (DAPO Eq. 13) with L_max = ``max_new_tokens`` and L_cache = ``buffer``:

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if |y| > L_max

    A linear ramp from 0 to -1 over the last ``buffer`` tokens of the generation budget, added to the reward
    so that a long answer is discouraged before it is cut off. ``buffer`` 0 disables it.
    """
    lengths = lengths.double()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_new_tokens - buffer
    ramp = (start - lengths) / buffer
    inside = torch.where(lengths <= max_new_tokens, ramp, torch.full_like(lengths, -1.0))
    return torch.where(lengths <= start, torch.zeros_like(lengths), inside)


def group_has_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per sample: does its group hold at least two different rewards? (DAPO dynamic sampling, Eq. 11's
    constraint 0 < |{correct}| < G.) A group whose rewards are all equal has zero advantage under any
    group-baseline estimator, so it contributes no policy gradient and only dilutes the batch."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    return (hi > lo)[inverse]

