"""Single-turn tasks over reasoning-gym's procedural datasets, scored by reasoning-gym's own scorers.

A task is a question, an answer and a scorer. Training items come from one seed and held-out items from
another, both deterministic; reasoning-gym generates item ``i`` from ``seed + i``, so datasets are lazy and
a large training size costs nothing.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from polyrl.config import TaskConfig

TRAIN_SIZE = 1_000_000
# Held-out items use a seed far from the training seed so the two streams do not share generator states.
EVAL_SEED_OFFSET = 7_919_000_003

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@cache
def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task_name(name: str, key: str = "task") -> None:
    if name not in task_names():
        raise ValueError(f"{key}: unknown task '{name}'; valid tasks: {', '.join(task_names())}")


def last_number(text: str) -> str | None:
    """The last number in a reply (the answer convention of the quickstart); commas inside it are dropped."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


class ReasoningGymTask:
    """One reasoning-gym dataset as a single-turn task: ``messages(item)`` and ``score(item, reply)``."""

    def __init__(self, config: TaskConfig, seed: int, system_prompt: str | None = None) -> None:
        import reasoning_gym

        check_task_name(config.name, key="task")
        self.config = config
        self.name = config.name
        self.system_prompt = system_prompt
        try:
            self.train = reasoning_gym.create_dataset(config.name, size=TRAIN_SIZE, seed=seed, **config.params)
            self.held_out = reasoning_gym.create_dataset(
                config.name, size=config.eval_size, seed=seed + EVAL_SEED_OFFSET, **config.params
            )
        except TypeError as exc:
            raise ValueError(f"task '{config.name}': bad params {config.params}: {exc}") from None

    def train_item(self, index: int) -> dict[str, Any]:
        return self.train[index % TRAIN_SIZE]

    def eval_items(self, n: int | None = None) -> list[dict[str, Any]]:
        n = len(self.held_out) if n is None else min(n, len(self.held_out))
        return [self.held_out[i] for i in range(n)]

    def messages(self, item: dict[str, Any]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        msgs.append({"role": "user", "content": item["question"] + self.config.prompt_suffix})
        return msgs

    def extract_answer(self, reply: str) -> str | None:
        if self.config.answer == "last_number":
            return last_number(reply)
        return reply.strip()

    def score(self, item: dict[str, Any], reply: str) -> float:
        """reasoning-gym's scorer on the extracted answer; a reply with no answer scores 0, never raises."""
        answer = self.extract_answer(reply)
        if answer is None:
            return 0.0
        try:
            return float(self.train.score_answer(answer, item))
        except Exception:  # noqa: BLE001 - a scorer choking on model output is a zero reward, not a crash
            return 0.0
