"""DAPO dynamic sampling (Yu et al. 2025, Eq. 11): keep only groups whose rewards differ, drawing more prompts
until the batch holds ``want`` such groups or the extra rounds run out."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.algorithms.dapo import group_has_variance
from polyrl.types import Trajectory

SampleRound = Callable[[int, int, int], list[Trajectory]]
"""``sample_round(round_index, n_prompts, first_group_id)`` rolls out and scores ``n_prompts`` new groups."""


@dataclass
class Sampled:
    kept: list[Trajectory]
    """The groups to train on, in sampling order."""
    sampled: list[Trajectory]
    """Everything rolled out this step (for honest reward and length metrics)."""
    rounds: int
    """Rollout rounds used, the first included."""
    zero_variance_groups: float
    """Fraction of all sampled groups whose rewards were all equal."""
    enabled: bool = False

    def metrics(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {"sampling/rounds": float(self.rounds), "sampling/kept_groups": float(len(_groups(self.kept)))}


def _groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    by_id: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_id.setdefault(t.group_id, []).append(t)
    return list(by_id.values())


def _has_variance(group: list[Trajectory]) -> bool:
    rewards = torch.tensor([t.reward for t in group])
    return bool(group_has_variance(rewards, torch.zeros(len(group), dtype=torch.long))[0])


def dynamic_sample(sample_round: SampleRound, want: int, enabled: bool, max_extra_rounds: int) -> Sampled:
    """Roll out ``want`` groups; when ``enabled``, drop zero-variance groups and refill.

    Each extra round draws the shortfall scaled up by the informative rate seen so far (capped at ``want``
    prompts, one batch, as DAPO does). Surplus informative groups beyond ``want`` are discarded. If no group
    is informative after all rounds, the first ``want`` groups are kept: under a group baseline their
    advantages are zero, so the update carries only the KL/entropy terms instead of failing the step.
    """
    sampled = sample_round(0, want, 0)
    rounds = 1
    while True:
        groups = _groups(sampled)
        informative = [g for g in groups if _has_variance(g)]
        zero_variance = 1.0 - len(informative) / max(len(groups), 1)
        if not enabled:
            return Sampled(sampled, sampled, 1, zero_variance)
        if len(informative) >= want or rounds > max_extra_rounds:
            break
        rate = len(informative) / len(groups)
        missing = want - len(informative)
        n = want if rate == 0 else min(want, math.ceil(missing / rate))
        next_id = max(t.group_id for t in sampled) + 1
        sampled = sampled + sample_round(rounds, n, next_id)
        rounds += 1
    chosen = informative[:want] if informative else groups[:want]
    return Sampled([t for g in chosen for t in g], sampled, rounds, zero_variance, enabled=True)
