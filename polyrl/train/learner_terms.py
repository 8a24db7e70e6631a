"""Pieces of the learner's update that need no learner state: the advantages a micro-batch's loss sees, the
cross-policy importance weights, and how micro-batch metrics add up."""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms import kl_estimate, kl_penalty_to_go
from polyrl.algorithms.corrections import truncated_importance_weight
from polyrl.algorithms.gae import gae, terminal_rewards
from polyrl.train.batch import Batch


def cross_policy_advantages(
    mb: Batch, rows: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages with truncated importance weights min(pi_old / mu, cap) on the rows another policy
    sampled; the learner's own rows keep weight 1. Metrics are over the cross-policy tokens."""
    weights = truncated_importance_weight(old_logp, mb.behaviour_logp, cap)
    weights = torch.where(rows[:, None] & (mb.loss_mask > 0), weights, torch.ones_like(weights))
    per_token = advantages[:, None] if advantages.dim() == 1 else advantages
    valid = (mb.loss_mask > 0) & rows[:, None]
    w = weights[valid]
    metrics = {"cross_policy/is_weight": float(w.mean()) if w.numel() else 1.0,
               "cross_policy/capped_frac": float((w >= cap).float().mean()) if w.numel() else 0.0}
    return per_token * weights, metrics


def loss_advantages(
    algo: Any,
    mb: Batch,
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    old_values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantages the loss sees ([B], or [B, T] with KL in the reward or GAE) and GAE's returns; GAE when
    ``old_values`` (the critic's) are given."""
    kl = None
    if algo.kl_in == "reward" and algo.kl_coef > 0 and ref_logp is not None:
        kl = kl_estimate(old_logp, ref_logp, algo.kl_estimator).detach()
    if old_values is None:
        if kl is None:
            return mb.advantages, None
        per_token = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
        return per_token + kl_penalty_to_go(kl, mb.loss_mask, algo.kl_coef), None
    token_rewards = terminal_rewards(rewards, mb.loss_mask)
    if kl is not None:
        token_rewards = token_rewards - algo.kl_coef * kl * mb.loss_mask
    advantages = gae(token_rewards, old_values, mb.loss_mask, algo.gamma, algo.lam)
    return advantages, advantages + old_values


def detach(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach()


def add_sums(into: dict[str, float], sums: dict[str, float]) -> None:
    """Add sums into ``into``; ``*/max`` keys keep the largest."""
    for key, v in sums.items():
        into[key] = max(into.get(key, v), v) if key.endswith("/max") else into.get(key, 0.0) + v


def accumulate(into: dict[str, float], metrics: dict[str, float], n: int) -> None:
    """Average micro-batch metrics over ``n`` contributions; ``*/max`` and ``*/min`` take the extreme."""
    for key, v in metrics.items():
        if key.endswith("/max"):
            into[key] = max(into.get(key, v), v)
        elif key.endswith("/min"):
            into[key] = min(into.get(key, v), v)
        else:
            into[key] = into.get(key, 0.0) + v / n
