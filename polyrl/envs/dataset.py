"""The dataset env: your rows as single-turn tasks, scored by a reward named in the config.

``tasks: [{name: qa, items: data/qa.jsonl, reward: my_rewards:score}]`` is a task: each row becomes a
prompt (``tasks[].prompt``, a template over its fields; or its chat messages; or its question), the reply is
scored by the named reward against the row (and its reference answer, ``answer_field``). Replies of one turn
are scored together (``batch_scorer``), so a batched reward is called once per round.
"""

from __future__ import annotations

import json
import string
from typing import Any

from polyrl.config import TaskConfig
from polyrl.data.items import dataset_source
from polyrl.envs.base import Env, Message, StepResult, Task, TaskContext, register_env
from polyrl.rewards.checks import CHECKS
from polyrl.rewards.functions import RewardFn, Sample

DEFAULT_REWARD = {"last_number": "last_number", "full": "exact", "math_verify": "math_verify"}
"""The checker a dataset task uses without ``reward``, by ``tasks[].answer``."""

_MISSING = object()


def field(row: dict[str, Any], path: str) -> Any:
    """``row[a][b]`` for ``path`` ``a.b``; ``_MISSING`` where a part is absent."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def template_fields(template: str) -> list[str]:
    """The top-level field names a ``str.format`` template reads (``{a[b]}`` reads ``a``)."""
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            names.append(name.split("[", 1)[0].split(".", 1)[0])
    return names


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


class RowFormat:
    """How a row becomes a prompt and a reference answer, from the task's config."""

    def __init__(self, config: TaskConfig, system_prompt: str | None, needs_answer: bool) -> None:
        self.config, self.system_prompt, self.needs_answer = config, system_prompt, needs_answer
        self.template_fields = template_fields(config.prompt) if config.prompt is not None else []

    def messages_field(self, row: dict[str, Any]) -> str | None:
        if self.config.messages_field is not None:
            return self.config.messages_field
        if self.config.prompt is None and self.config.question_field is None and isinstance(row.get("prompt"), list):
            return "prompt"
        return None

    def _question_field(self, row: dict[str, Any]) -> str:
        if self.config.question_field is not None:
            return self.config.question_field
        return "question" if "question" in row or not isinstance(row.get("prompt"), str) else "prompt"

    def _answer_field(self, row: dict[str, Any]) -> str:
        if self.config.answer_field is not None:
            return self.config.answer_field
        return "answer" if "answer" in row or field(row, "reward_model.ground_truth") is _MISSING \
            else "reward_model.ground_truth"

    def problem(self, row: dict[str, Any]) -> str | None:
        """What is wrong with a row for this task, naming the field; None when it can be played (a template
        that still cannot be filled fails in ``key``, which fills it)."""
        if self.config.prompt is not None:
            for name in self.template_fields:
                if name not in row:
                    return f"no field '{name}' (tasks[].prompt reads it)"
        elif (messages := self.messages_field(row)) is not None:
            value = field(row, messages)
            if value is _MISSING:
                return f"no field '{messages}' (messages_field)"
            if not _is_messages(value):
                return f"field '{messages}' is not a list of chat messages ({{role, content}} objects)"
        else:
            question = self._question_field(row)
            value = field(row, question)
            if value is _MISSING:
                return (f"no field '{question}' (give question_field, a prompt template, or messages_field; "
                        f"the row has {', '.join(sorted(row)) or 'no fields'})")
            if not isinstance(value, str):
                return f"field '{question}' is a {type(value).__name__}, not text"
        if self.needs_answer:
            answer = self._answer_field(row)
            value = field(row, answer)
            if value is _MISSING or value is None:
                return (f"no field '{answer}' (the reward compares with it; set answer_field, or audit: false "
                        "for a reward that needs no reference)")
        return None

    def messages(self, row: dict[str, Any]) -> list[Message]:
        config = self.config
        if config.prompt is not None:
            msgs: list[Message] = [{"role": "user", "content": config.prompt.format_map(row)}]
        elif (messages := self.messages_field(row)) is not None:
            msgs = [dict(m) for m in field(row, messages)]
            if msgs[-1]["role"] == "assistant":  # a reference reply in the conversation is not the prompt
                msgs = msgs[:-1]
        else:
            msgs = [{"role": "user", "content": field(row, self._question_field(row))}]
        if config.prompt_suffix:
            last = max(i for i, m in enumerate(msgs) if m["role"] == "user") if any(
                m["role"] == "user" for m in msgs) else len(msgs) - 1
            msgs[last] = {**msgs[last], "content": msgs[last]["content"] + config.prompt_suffix}
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def answer(self, row: dict[str, Any]) -> Any:
        value = field(row, self._answer_field(row))
        return None if value is _MISSING else value

    def prompt(self, row: dict[str, Any]) -> Any:
        """The row's prompt as given, for TRL-style rewards (its messages, else the rendered user text)."""
        messages = self.messages_field(row)
        if messages is not None:
            return field(row, messages)
        return self.messages(row)[-1]["content"]

    def key(self, row: dict[str, Any]) -> bytes:
        """The held-out split's key: the prompt as written (template filled, messages, or question), so one
        question is never on both sides."""
        if self.config.prompt is not None:
            return self.config.prompt.format_map(row).encode()
        if (messages := self.messages_field(row)) is not None:
            return json.dumps(field(row, messages), sort_keys=True, default=str).encode()
        return str(field(row, self._question_field(row))).encode()


class DatasetEnv(Env):
    """One row, one reply, one reward; replies of a turn are scored together by the task."""

    def __init__(self, task: DatasetTask) -> None:
        self.batch_scorer = task
        self.item: dict[str, Any] = {}

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.item = item
        return self.batch_scorer.format.messages(item)

    def step(self, assistant_message: str) -> StepResult:
        return self.batch_scorer.step_many([self], [assistant_message])[0]


class DatasetTask(Task):
    """Rows from ``items`` / ``eval_items`` played as single-turn episodes, scored by ``reward``."""

    def __init__(self, config: TaskConfig, seed: int, system_prompt: str | None = None) -> None:
        reference = config.reward or DEFAULT_REWARD[config.answer]
        self.reward = RewardFn(reference, config.reward_params, config.reward_timeout_s, "task.reward")
        check = CHECKS.get(reference)
        needs_answer = config.audit.enabled or (check is not None and check.needs_answer)
        self.format = RowFormat(config, system_prompt, needs_answer)
        super().__init__(config, lambda: DatasetEnv(self), seed=seed,
                         source=dataset_source(config, seed, key=self.format.key, check=self.format.problem))

    def reference_answer(self, row: dict[str, Any]) -> Any:
        return self.format.answer(row)

    @property
    def reference_template(self) -> str:
        return self.config.reference or self.config.audit.reply

    def sample(self, row: dict[str, Any], reply: str) -> Sample:
        conversational = self.format.messages_field(row) is not None
        return Sample(reply, row, self.format.answer(row), self.format.prompt(row), conversational)

    def step_many(self, envs: list[DatasetEnv], replies: list[str]) -> list[StepResult]:
        scored = self.reward.score([self.sample(env.item, reply) for env, reply in zip(envs, replies, strict=True)])
        results = []
        for s in scored:
            info: dict[str, Any] = {"score": s.reward}
            if s.terms:
                info["reward_terms"] = s.terms
            if s.error is not None:
                info["reward_error"] = s.error
            results.append(StepResult([], s.reward, True, info))
        return results


def _check(config: TaskConfig, key: str) -> None:
    if config.items is None:
        raise ValueError(f"{key}.items: the dataset env needs rows (a file, a folder, a glob, or a list)")
    if config.reward is None and config.reward_params:
        raise ValueError(f"{key}.reward_params: set for no reward; name a built-in checker in {key}.reward")
    RewardFn(config.reward or DEFAULT_REWARD[config.answer], config.reward_params, config.reward_timeout_s,
             f"{key}.reward", f"{key}.reward_params")
    if config.prompt is not None:
        try:
            template_fields(config.prompt)
        except ValueError as exc:
            raise ValueError(f"{key}.prompt: not a valid template ({exc})") from None


@register_env("dataset", check=_check)
def dataset_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Your rows (tasks[].items: jsonl, json, csv, parquet, a datasets folder) scored by tasks[].reward."""
    return DatasetTask(config, ctx.seed, ctx.system_prompt)
