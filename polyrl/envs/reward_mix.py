"""Rewards made of weighted components (``tasks[].reward_components``): the env's own reward, LLM-as-judge
scores, rules and named rewards (built-in checkers or your functions), mixed by weight after a round is rolled
out (before advantages and DAPO's filter)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from polyrl.config import RewardComponentConfig, component_names
from polyrl.envs.base import Task
from polyrl.models.device import resolve_device
from polyrl.rewards.functions import RewardFn, Sample
from polyrl.rewards.judge import Judge
from polyrl.types import Trajectory


def rule_scores(pattern: str, responses: Sequence[str]) -> list[float]:
    """A rubric's rule criterion: 1.0 for each response in which the regular expression ``pattern`` is found
    (``re.search`` over the whole text: ``^``/``$`` are its start and end unless the pattern sets ``(?m)``),
    else 0.0."""
    compiled = re.compile(pattern)
    return [1.0 if compiled.search(r) else 0.0 for r in responses]


def weighted_reward(values: dict[str, float], weights: dict[str, float]) -> float:
    """sum_k w_k * r_k over the components; a weight without a value is a bug, not a zero."""
    missing = set(weights) - set(values)
    if missing:
        raise ValueError(f"reward components {sorted(missing)} have no value")
    return sum(weights[k] * values[k] for k in weights)


def reference_of(item: dict[str, Any], task: str) -> str:
    """The item's reference answer for a judge with ``reference: true``."""
    if "answer" not in item:
        raise ValueError(f"tasks[{task}].reward_components: reference needs the item's 'answer', and this "
                         f"task's items have none (keys: {', '.join(sorted(item))})")
    return str(item["answer"])


def question_of(task: Task, item: dict[str, Any]) -> str:
    """The last user message an episode on ``item`` opens with (what a judge is asked about)."""
    messages = task.make_env().reset(item)
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def sample_of(task: Task, item: dict[str, Any], response: str) -> Sample:
    """What a named reward sees of a response: a dataset task's own view of its row, else the item with its
    ``answer`` and the question it was asked."""
    if hasattr(task, "sample"):
        return task.sample(item, response)
    return Sample(response, item, item.get("answer"), question_of(task, item))


class RewardMixer:
    """Applies each task's reward components; judges are loaded once per model name and shared."""

    def __init__(
        self, tasks: dict[str, Task], tokenizer: Any, default_judge: str, seed: int = 0, device: str = "cpu"
    ) -> None:
        """``device``: ``train.device``'s value, resolved when a judge is first loaded (runs without judges
        never touch the GPU for it)."""
        self.tasks, self.tokenizer, self.default_judge, self.seed = tasks, tokenizer, default_judge, seed
        self.device = device
        self.judges: dict[str, Judge] = {}
        self.functions: dict[tuple[str, str], RewardFn] = {}
        self.active = any(t.config.reward_components for t in tasks.values())

    def judge(self, name: str | None) -> Judge:
        name = name or self.default_judge
        if name not in self.judges:
            self.judges[name] = Judge(name, seed=self.seed, device=resolve_device(self.device))
        return self.judges[name]

    def reward_fn(self, task: str, key: str, comp: RewardComponentConfig) -> RewardFn:
        if (task, key) not in self.functions:
            timeout = self.tasks[task].config.reward_timeout_s
            self.functions[task, key] = RewardFn(comp.reward, comp.params, timeout, f"tasks[{task}].reward_components")
        return self.functions[task, key]

    def apply(self, trajectories: Sequence[Trajectory], items: dict[int, dict[str, Any]]) -> None:
        """Replace each trajectory's reward by its task's weighted components; ``items`` maps group id to the
        item the group played. The env's reward is kept under ``rewards["env"]``."""
        if not self.active:
            return
        for name, task in self.tasks.items():
            comps = task.config.reward_components
            mine = [t for t in trajectories if t.task == name]
            if not comps or not mine:
                continue
            keys = component_names(comps)
            values: list[dict[str, float]] = [{} for _ in mine]
            questions = {t.group_id: question_of(task, items[t.group_id]) for t in mine}
            for key, comp in zip(keys, comps, strict=True):
                if comp.kind == "env":
                    scores = [t.reward for t in mine]
                elif comp.kind == "rule":
                    scores = rule_scores(comp.pattern, [self._response(t) for t in mine])
                elif comp.kind == "reward":
                    scored = self.reward_fn(name, key, comp).score(
                        [sample_of(task, items[t.group_id], self._response(t)) for t in mine])
                    scores = [s.reward for s in scored]
                    for t, s in zip(mine, scored, strict=True):
                        if s.error is not None:
                            t.info["reward_error"] = s.error
                else:
                    pairs = [(questions[t.group_id], self._response(t)) for t in mine]
                    refs = [reference_of(items[t.group_id], name) for t in mine] if comp.reference else None
                    scores = self.judge(comp.model).score(pairs, comp.rubric, refs)
                for v, s in zip(values, scores, strict=True):
                    v[key] = float(s)
            weights = {k: c.weight for k, c in zip(keys, comps, strict=True)}
            for t, v in zip(mine, values, strict=True):
                t.rewards = {**v}
                t.reward = weighted_reward(v, weights)

    def _response(self, t: Trajectory) -> str:
        ids = [i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
