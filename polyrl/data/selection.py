"""Prompt selection by predicted pass rate (``rollout.prompt_selection``): spend a step's samples on the prompts
whose groups are likely to disagree, at the same samples per step.

MoPPS (Qu et al. 2025, "Can Prompt Difficulty be Online Predicted for Accelerating RL Finetuning of Reasoning
Models?") keeps a Beta posterior of each prompt's success rate, updated from every group it is sampled in and
decayed toward its prior so that it follows the changing policy; each round draws ``candidates`` times the
prompts it needs, samples a success rate for each from its posterior (Thompson sampling) and keeps the prompts
whose sampled rate is closest to ``target``. A group of a prompt the policy always solves or always fails has
zero advantage under a group baseline; this spends the round's samples elsewhere instead of refilling after
(DAPO's dynamic sampling, which then has less to refill).

Items with the same content (every field but ``metadata``) share one estimate: a procedural task that repeats
questions, or a dataset over several epochs, learns each question's pass rate. An item never sampled has the
prior Beta(1, 1). The state is a dict of plain numbers, kept in checkpoints, and the draws are seeded by (seed,
step, round): a resumed run selects exactly what an uninterrupted one would.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PRIOR = (1.0, 1.0)
"""Beta(1, 1): an item never sampled is equally likely to have any pass rate."""


def item_key(task: str, item: dict[str, Any]) -> str:
    """The identity of an item for its estimate: the task and every field but ``metadata`` (which holds
    stream positions such as an index, not the problem)."""
    content = {k: v for k, v in item.items() if k != "metadata"}
    return task + "/" + json.dumps(content, sort_keys=True, default=str)


def updated(posterior: Sequence[float], successes: int, samples: int, decay: float) -> tuple[float, float]:
    """The Beta posterior after a group of ``samples`` with ``successes``: the old evidence decayed toward the
    prior by ``decay`` (1 keeps all of it, 0 forgets it), then the new counts added (MoPPS, Eq. 5)."""
    alpha, beta = posterior
    return (decay * alpha + (1 - decay) * PRIOR[0] + successes,
            decay * beta + (1 - decay) * PRIOR[1] + samples - successes)


def mixed_group_chance(rate: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` samples at pass rate ``rate`` holds both a success and a
    failure: the groups a group baseline learns from."""
    return 1.0 - rate**group_size - (1.0 - rate) ** group_size


@dataclass
class Choice:
    chosen: list[int]
    """Indices into the candidates, in candidate order."""
    predicted: list[float]
    """The posterior mean pass rate of each chosen candidate."""
    known: int
    """How many chosen candidates had been sampled before."""


class PromptSelector:
    """Beta posteriors per item, and the choice of a round's prompts among its candidates."""

    def __init__(self, candidates: int, target: float, decay: float, seed: int) -> None:
        self.candidates, self.target, self.decay, self.seed = candidates, target, decay, seed
        self.posteriors: dict[str, tuple[float, float]] = {}

    def choose(self, keys: Sequence[str], n: int, step: int, round_index: int) -> Choice:
        """Keep ``n`` of the candidate ``keys``: those whose Thompson-sampled pass rate lies closest to
        ``target`` (ties kept in candidate order)."""
        rng = random.Random(f"selection-{self.seed}-{step}-{round_index}")
        drawn = [rng.betavariate(*self.posteriors.get(key, PRIOR)) for key in keys]
        order = sorted(range(len(keys)), key=lambda i: (abs(drawn[i] - self.target), i))
        chosen = sorted(order[:n])
        predicted = [self.mean(keys[i]) for i in chosen]
        return Choice(chosen, predicted, sum(keys[i] in self.posteriors for i in chosen))

    def mean(self, key: str) -> float:
        alpha, beta = self.posteriors.get(key, PRIOR)
        return alpha / (alpha + beta)

    def observe(self, key: str, successes: int, samples: int) -> None:
        """A group of the item ``key`` was sampled and scored."""
        if samples:
            self.posteriors[key] = updated(self.posteriors.get(key, PRIOR), successes, samples, self.decay)

    def select(self, requests: Sequence[tuple[Any, int, dict[str, Any]]], n: int, step: int, round_index: int,
               group_size: int) -> tuple[list[tuple[Any, int, dict[str, Any]]], dict[str, float]]:
        """``n`` of the candidate (task, item index, item) ``requests``, and counts that add up over a step's
        rounds: ``selection/known_items`` (chosen items sampled before) and ``selection/expected_mixed_groups``
        (the groups predicted to hold a success and a failure, at each item's posterior mean)."""
        choice = self.choose([item_key(task.name, item) for task, _, item in requests], n, step, round_index)
        expected = sum(mixed_group_chance(rate, group_size) for rate in choice.predicted)
        return [requests[i] for i in choice.chosen], {"selection/known_items": float(choice.known),
                                                       "selection/expected_mixed_groups": expected}

    def state_dict(self) -> dict[str, list[float]]:
        return {key: list(posterior) for key, posterior in self.posteriors.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.posteriors = {key: (float(a), float(b)) for key, (a, b) in state.items()}
