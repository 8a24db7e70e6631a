"""Single-turn tasks over reasoning-gym's procedural datasets, scored by reasoning-gym's own scorers.

A task is a question, an answer and a scorer, played through the same env protocol as multi-turn tasks
(``SingleTurnEnv``: reset asks, the first step scores and ends). Training items come from one seed and
held-out items from another, both deterministic; reasoning-gym generates item ``i`` from ``seed + i``, so
datasets are lazy and a large training size costs nothing.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from polyrl.config import TaskConfig
from polyrl.data.items import GeneratedSource
from polyrl.envs.base import EVAL_SEED_OFFSET, Env, Message, SingleTurnEnv, Task, TaskContext, register_env
from polyrl.rewards.checks import last_number
from polyrl.rewards.math import math_verify_score

TRAIN_SIZE = 1_000_000

@cache
def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task_name(name: str, key: str = "task") -> None:
    if name not in task_names():
        raise ValueError(f"{key}: unknown task '{name}'; valid tasks: {', '.join(task_names())}")


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def make_datasets(name: str, params: dict[str, Any], seed: int, eval_size: int) -> tuple[Any, Any]:
    """(training stream, held-out set) of one reasoning-gym dataset; bad params are a one-line ValueError."""
    import reasoning_gym

    check_task_name(name, key="task")
    try:
        train = reasoning_gym.create_dataset(name, size=TRAIN_SIZE, seed=seed, **params)
        held_out = reasoning_gym.create_dataset(name, size=eval_size, seed=seed + EVAL_SEED_OFFSET, **params)
        train[0]  # items are generated lazily: make params that only fail there fail now
    except Exception as exc:  # noqa: BLE001 - whatever a dataset constructor raises, the params are bad
        raise ValueError(f"task '{name}': bad params {params}: {_first_line(exc)}") from None
    return train, held_out


def score_answer(dataset: Any, item: dict[str, Any], answer: str | None) -> float:
    """reasoning-gym's scorer on an extracted answer; no answer scores 0, and the scorer never raises."""
    if answer is None:
        return 0.0
    try:
        return float(dataset.score_answer(answer, item))
    except Exception:  # noqa: BLE001 - a scorer choking on model output is a zero reward, not a crash
        return 0.0


def extract_answer(config: TaskConfig, reply: str) -> str | None:
    if config.answer == "last_number":
        return last_number(reply)
    return reply.strip()


class ReasoningGymTask(Task):
    """One reasoning-gym dataset as a single-turn task: ``messages(item)`` and ``score(item, reply)``."""

    def __init__(
        self,
        config: TaskConfig,
        seed: int,
        system_prompt: str | None = None,
        dataset: str | None = None,
        dataset_params: dict[str, Any] | None = None,
    ) -> None:
        """``dataset`` / ``dataset_params`` default to the task's name and params (envs built on a
        reasoning-gym dataset, like tool_math, pass their own)."""
        self.system_prompt = system_prompt
        self.dataset = dataset or config.name
        params = config.params if dataset_params is None else dataset_params
        self.train, self.held_out = make_datasets(self.dataset, params, seed, config.eval_size)
        source = GeneratedSource(lambda i: self.train[i % TRAIN_SIZE], lambda i: self.held_out[i],
                                 eval_limit=len(self.held_out))
        super().__init__(config, self._env, seed=seed, source=source)

    def _env(self) -> Env:
        return SingleTurnEnv(self.messages, self.score)

    def messages(self, item: dict[str, Any]) -> list[Message]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        msgs.append({"role": "user", "content": item["question"] + self.config.prompt_suffix})
        return msgs

    def extract_answer(self, reply: str) -> str | None:
        return extract_answer(self.config, reply)

    def score(self, item: dict[str, Any], reply: str) -> float:
        """reasoning-gym's scorer on the extracted answer (or, with ``answer: math_verify``, math-verify's
        equality check against the item's answer); a reply with no answer scores 0, never raises."""
        if self.config.answer == "math_verify":
            return math_verify_score(item["answer"], reply)
        return score_answer(self.train, item, self.extract_answer(reply))


def check_params(name: str, params: dict[str, Any], key: str = "task") -> None:
    """The params a reasoning-gym dataset would be built with, checked by its own config class (without
    generating anything), so a misspelt or out-of-range param fails when the config loads."""
    from reasoning_gym.factory import DATASETS

    reserved = sorted({"size", "seed"} & set(params))
    if reserved:
        raise ValueError(f"{key}.params.{reserved[0]}: set by polyrl (train.seed, eval_size), not a task param")
    config_cls = DATASETS[name][1]
    try:
        dataset_config = config_cls(**params)
        if hasattr(dataset_config, "validate"):
            dataset_config.validate()
    except Exception as exc:  # noqa: BLE001 - whatever a dataset's config raises, the params are bad
        raise ValueError(f"{key}.params: {_first_line(exc)}") from None


def _check(config: TaskConfig, key: str) -> None:
    check_task_name(config.name, key=f"{key}.name")
    check_params(config.name, config.params, key)


@register_env("reasoning_gym", check=_check)
def reasoning_gym_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """A reasoning-gym dataset named by the task's name; params go to the dataset constructor."""
    return ReasoningGymTask(config, ctx.seed, ctx.system_prompt)
