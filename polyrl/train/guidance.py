"""Guidance for groups whose samples all fail (``guidance``, docs/guidance.md).

A group in which every sample fails has zero advantage under a group baseline: what the policy never samples,
it never learns. When a round's group is all-fail, the item's reference reply (``Task.reference_reply``, or
the env's own demonstration where it has one) is played through the env like a rollout, and when the env
scores it a success it takes the place of the group's last sample, marked ``guided``. The group's advantages
are then computed over the mix, as LUFFY's are (Yan et al. 2025), and the learner trains the reference's
tokens with the shaped objective of ``polyrl.algorithms.guidance``, their log-probs its own.
A reference the env does not score a success is never mixed in: the policy is taught only what the task
rewards. Hints (the item sampled again with the start of its reference in the prompt) run before the mixing,
in ``polyrl.train.hints``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from polyrl.config import GuidanceConfig
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task
from polyrl.rollout.multi_turn import start_episode, to_trajectory
from polyrl.train.demonstrations import env_demonstration, play_replies
from polyrl.types import Trajectory


def all_fail_groups(trajectories: list[Trajectory], success_score: float) -> dict[int, list[int]]:
    """Group id -> its rows, for each group in which no sample's score (``info.score``, else its reward)
    reaches ``success_score``; in the order the groups first appear."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        groups[t.group_id].append(i)
    return {gid: rows for gid, rows in groups.items()
            if not any(float(trajectories[i].info.get("score", trajectories[i].reward)) >= success_score
                       for i in rows)}


class Guidance:
    """Mixes reference replies into all-fail groups, with a probability annealed over the run's steps."""

    def __init__(self, config: GuidanceConfig, tokenizer: Any, max_new_tokens: int, seed: int) -> None:
        self.config, self.tokenizer, self.max_new_tokens, self.seed = config, tokenizer, max_new_tokens, seed

    def probability(self, step: int) -> float:
        c = self.config
        if c.anneal_steps <= 0:
            return c.probability
        return c.probability * max(0.0, 1.0 - (step - 1) / c.anneal_steps)

    def mix_in(
        self, trajectories: list[Trajectory], requests: dict[int, tuple[Task, int, dict[str, Any]]], step: int
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Replace the last sample of each all-fail group (``requests`` maps a group id to its task, item index
        and item) by the item's reference, in place; returns the references mixed in and the counts
        ``guidance/all_fail_groups``, ``guidance/guided`` and ``guidance/unusable``
        (groups whose item had no reference, or one the env did not score a success, or longer than a
        rollout may be)."""
        failing = all_fail_groups(trajectories, self.config.success_score)
        # With only hints on (reference off), all-fail groups are still counted, none gets a reference.
        p = self.probability(step) if self.config.reference else 0.0
        unusable, guided = 0, []
        for gid, rows in failing.items():
            if random.Random(f"guidance-{self.seed}-{step}-{gid}").random() >= p:
                continue
            task, index, item = requests[gid]
            reference = self.reference(task, index, item)
            if reference is None:
                unusable += 1
                continue
            reference.group_id, reference.guided = gid, True
            trajectories[rows[-1]] = reference
            guided.append(reference)
        metrics = {"guidance/all_fail_groups": float(len(failing)),
                   "guidance/guided": float(len(guided)), "guidance/unusable": float(unusable)}
        return guided, metrics

    def reference(self, task: Task, index: int, item: dict[str, Any]) -> Trajectory | None:
        """The item's reference played through its env as a trajectory; None when there is none, the env does
        not score it a success, or a turn of it is longer than ``rollout.max_new_tokens``."""
        if isinstance(task, AgentTask):  # an agent's episodes run through its own client code, not replies
            return None
        episode = start_episode(task, index, item, 0, self.tokenizer)
        replies = env_demonstration(episode)
        if not replies:
            reply = task.reference_reply(item)
            replies = [reply] if reply else None
        if not replies or any(len(episode.renderer.encode(r)) + 1 > self.max_new_tokens for r in replies):
            return None
        if play_replies(episode, replies, self.tokenizer) is not None:
            return None
        trajectory = to_trajectory(episode, self.tokenizer)
        trajectory.text = "\n".join(replies)
        return trajectory
