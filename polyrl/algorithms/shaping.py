"""Applying the pure functions to a step's trajectories: reward shaping, then one advantage per sample."""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.advantages import ADVANTAGES, MULTI_REWARD
from polyrl.algorithms.dapo import overlong_penalty
from polyrl.algorithms.task_norm import task_normalise
from polyrl.types import Trajectory


def shape_rewards(trajectories: list[Trajectory], algo: Any, max_new_tokens: int) -> dict[str, float]:
    """Add DAPO's overlong penalty (``algo.overlong_buffer`` > 0) to each reward, recorded as
    ``rewards["overlong"]``; returns its mean as a metric (nothing when the penalty is off)."""
    if algo.overlong_buffer <= 0 or not trajectories:
        return {}
    lengths = torch.tensor([t.num_model_tokens for t in trajectories])
    penalty = algo.overlong_penalty * overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer)
    for t, p in zip(trajectories, penalty.tolist(), strict=True):
        t.rewards["overlong"] = p
        t.reward += p
    return {"reward/overlong": float(penalty.mean())}


def assign_advantages(trajectories: list[Trajectory], algo: Any) -> None:
    """Set each trajectory's ``advantage`` from ``algo.advantage`` over the rewards and group ids, then
    normalise within each task when ``algo.task_norm``."""
    if not trajectories:
        return
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    if algo.advantage in MULTI_REWARD:
        rewards = reward_components(trajectories)
    groups = torch.tensor([t.group_id for t in trajectories])
    advantages = ADVANTAGES[algo.advantage](rewards, groups, **algo.advantage_kwargs)
    if getattr(algo, "task_norm", False):
        names = sorted({t.task for t in trajectories})
        task_ids = torch.tensor([names.index(t.task) for t in trajectories])
        advantages = task_normalise(advantages, task_ids)
    for t, a in zip(trajectories, advantages.tolist(), strict=True):
        t.advantage = a


def reward_components(trajectories: list[Trajectory]) -> torch.Tensor:
    """[N, K] reward components, one column per name in any trajectory's ``rewards`` (sorted; 0 where a
    trajectory lacks it: components belong to a task, and groups never mix tasks). Trajectories that record
    no component give their summed reward as the one column."""
    names = sorted({k for t in trajectories for k in t.rewards})
    if not names:
        return torch.tensor([[t.reward] for t in trajectories], dtype=torch.float32)
    return torch.tensor([[t.rewards.get(k, 0.0) for k in names] for t in trajectories], dtype=torch.float32)
