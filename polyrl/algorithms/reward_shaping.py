"""Reward shaping of a step's trajectories before their advantages: DAPO's overlong penalty and gated shaping,
with the mean of each reward component as scored."""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.dapo import overlong_penalty
from polyrl.types import Trajectory


def shape_rewards(trajectories: list[Trajectory], algo: Any, max_new_tokens: int) -> dict[str, float]:
    """Add DAPO's overlong penalty (``algo.shaping.overlong_buffer`` > 0) to each reward, recorded as
    ``rewards["overlong"]``, then gate the shaping components (``algo.advantage.reward_gate``); returns the
    penalty's mean, each reward component's mean (``criterion_means``) and the gate's metrics."""
    metrics = _overlong(trajectories, algo.shaping, max_new_tokens)
    metrics.update(criterion_means(trajectories))  # as scored, before the gate withholds any
    gate = algo.advantage.reward_gate
    if gate is not None and trajectories:
        metrics.update(gate_rewards(trajectories, gate.outcome, gate.threshold, gate.gated))
    return metrics


def criterion_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """``reward/criterion/<name>``: the mean of each reward component (``tasks[].reward_components``: env,
    judge and rule criteria) over the trajectories that have it. The task-named total of a task without
    components and the overlong penalty (``reward/overlong``) are reported elsewhere."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for k, v in t.rewards.items():
            if k not in (t.task, "overlong"):
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
    return {f"reward/criterion/{k}": sums[k] / counts[k] for k in sorted(sums)}


def gate_rewards(
    trajectories: list[Trajectory], outcome: str, threshold: float, gated: list[str] | None = None
) -> dict[str, float]:
    """Gated shaping: a trajectory whose outcome component ``rewards[outcome]`` is below ``threshold`` loses the
    positive part of every ``gated`` component (all components but ``outcome`` when empty): r <- r - max(r_k, 0),
    and ``rewards[k]`` becomes min(r_k, 0). Shaping (format, length, a judge's style score, step rewards)
    then pays only for solved episodes, so it cannot be farmed without solving, while penalties still apply.
    Returns ``reward/gated_frac``, the fraction of trajectories whose shaping was withheld. A trajectory
    without the ``outcome`` component is a config error naming ``algorithm.advantage.reward_gate.outcome``.
    """
    withheld = 0
    for t in trajectories:
        if outcome not in t.rewards:
            have = ", ".join(sorted(t.rewards)) or "none"
            raise ValueError(f"algorithm.advantage.reward_gate.outcome: no reward component '{outcome}' in task "
                             f"'{t.task}' (its components: {have})")
        if t.rewards[outcome] >= threshold:
            continue
        names = gated or [k for k in t.rewards if k != outcome]
        removed = sum(max(t.rewards.get(k, 0.0), 0.0) for k in names)
        for k in names:
            if k in t.rewards:
                t.rewards[k] = min(t.rewards[k], 0.0)
        t.reward -= removed
        withheld += removed > 0
    return {"reward/gated_frac": withheld / len(trajectories)}


def _overlong(trajectories: list[Trajectory], shaping: Any, max_new_tokens: int) -> dict[str, float]:
    if shaping.overlong_buffer <= 0 or not trajectories:
        return {}
    lengths = torch.tensor([t.num_model_tokens for t in trajectories])
    penalty = shaping.overlong_penalty * overlong_penalty(lengths, max_new_tokens, shaping.overlong_buffer)
    for t, p in zip(trajectories, penalty.tolist(), strict=True):
        t.rewards["overlong"] = p
        t.reward += p
    return {"reward/overlong": float(penalty.mean())}
