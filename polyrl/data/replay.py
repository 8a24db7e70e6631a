"""Success replay and prompt replay for agent training; both states go into checkpoints.

Success replay (Lu et al. 2025, "ARPO: End-to-End Policy Optimization for GUI Agents with Experience
Replay"; Zhang et al. 2025, "RLEP: Reinforcement Learning with Experience Replay"): each item keeps a few
verified successful trajectories; when every sample of a group fails (no learning signal under a group
baseline), one stored success replaces a sample, so the group has a positive example. A replayed sample
keeps its stored tokens and behaviour log-probs and is marked ``replayed``; the learner corrects for it
being off-policy with a truncated importance weight (``polyrl.algorithms.corrections``).

Prompt replay re-draws items already seen, weighted by p (1 - p) of their pass rate p so far: items
solved about half the time carry the most signal for a group baseline (the variance of a Bernoulli reward).
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict

from polyrl.data.sampler import Draw
from polyrl.types import Trajectory

# Fields that tie a trajectory to the step it was sampled in; a stored success is a standalone sample.
_STEP_FIELDS = ("branch_id", "parent_id", "branch_at", "arpo_branch_points")


def is_success(t: Trajectory, score: float) -> bool:
    return float(t.info.get("score", t.reward)) >= score


def _key(t: Trajectory) -> str:
    return f"{t.task}/{t.item_id}"


def _groups(trajectories: list[Trajectory]) -> dict[int, list[Trajectory]]:
    by_id: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_id[t.group_id].append(t)
    return by_id


class SuccessBuffer:
    """Up to ``size`` successful trajectories per item, newest kept."""

    def __init__(self, size: int, score: float, ratio: float, seed: int) -> None:
        self.size, self.score, self.ratio, self.seed = size, score, ratio, seed
        self.store: dict[str, list[Trajectory]] = {}

    def mix_in(self, trajectories: list[Trajectory], step: int) -> dict[str, float]:
        """Replace the last sample of each all-fail group that has a stored success (with probability
        ``ratio``, seeded by step and group) by that success; then store this step's new successes.
        Returns ``replay/all_fail_groups`` (fraction, before mixing) and ``replay/replayed`` (count)."""
        groups = _groups(trajectories)
        all_fail, replayed = 0, 0
        for gid, group in groups.items():
            if any(is_success(t, self.score) for t in group):
                continue
            all_fail += 1
            stored = self.store.get(_key(group[0]))
            rng = random.Random(f"{self.seed}-{step}-{gid}")
            if not stored or rng.random() >= self.ratio:
                continue
            # The last sample is replaced: in an ARPO tree it is the newest leaf, so no other leaf descends from it.
            victim = group[-1]
            sample = copy.deepcopy(rng.choice(stored))
            sample.group_id, sample.replayed = gid, True
            sample.advantage, sample.token_advantages = 0.0, None
            trajectories[next(i for i, t in enumerate(trajectories) if t is victim)] = sample
            replayed += 1
        self.add(trajectories)
        return {"replay/all_fail_groups": all_fail / max(len(groups), 1), "replay/replayed": float(replayed)}

    def add(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            if t.replayed or not is_success(t, self.score):
                continue
            stored = copy.deepcopy(t)
            for name in _STEP_FIELDS:
                stored.info.pop(name, None)
            stored.advantage, stored.token_advantages = 0.0, None
            bucket = self.store.setdefault(_key(t), [])
            bucket.append(stored)
            del bucket[: -self.size]

    def state_dict(self) -> dict:
        return {k: [t.to_json() for t in v] for k, v in self.store.items()}

    def load_state_dict(self, state: dict) -> None:
        self.store = {k: [Trajectory.from_json(line) for line in v] for k, v in state.items()}


class PromptReplay:
    """Pass-rate statistics per item, and draws that favour pass rates near 0.5."""

    def __init__(self, fraction: float, score: float, seed: int) -> None:
        self.fraction, self.score, self.seed = fraction, score, seed
        self.stats: dict[str, list[int]] = {}  # "task/index" -> [successes, samples]

    def update(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            if t.replayed:  # a stored success says nothing about the current policy's pass rate
                continue
            s = self.stats.setdefault(_key(t), [0, 0])
            s[0] += int(is_success(t, self.score))
            s[1] += 1

    def weight(self, key: str) -> float:
        wins, n = self.stats[key]
        p = wins / n
        return p * (1 - p) + 1e-3  # never exactly zero: an item can still come back

    def count(self, n: int) -> int:
        """How many of ``n`` prompts are replayed (none before any item has been seen)."""
        return min(int(self.fraction * n + 0.5), n) if self.stats else 0

    def draw(self, step: int, k: int, round_index: int = 0) -> list[Draw]:
        """``k`` seen items, without repeats where possible, chosen by weight; seeded by (seed, step, round)."""
        keys = sorted(self.stats)
        rng = random.Random(f"replay-{self.seed}-{step}-{round_index}")
        chosen: list[str] = []
        pool = list(keys)
        while len(chosen) < k and pool:
            pick = rng.choices(pool, weights=[self.weight(x) for x in pool])[0]
            chosen.append(pick)
            pool.remove(pick)
        while len(chosen) < k:
            chosen.append(rng.choice(keys))
        return [Draw(key.rsplit("/", 1)[0], int(key.rsplit("/", 1)[1])) for key in chosen]

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {k: list(v) for k, v in state.items()}
