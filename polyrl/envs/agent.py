"""Agent tasks: the user's own agent code, ``async def run(client, item) -> reward``, named in the config as
``tasks: [{name: my_agent, agent: "my_pkg.agents:run", items: [...]}]``.

The task holds the agent and its items; it has no env. Its episodes are played by ``polyrl.endpoint.rollout``,
which hands each episode an ``openai.AsyncOpenAI`` client on the policy's endpoint and trains on the calls.
Items come from ``items`` (inline or a .json / .jsonl file) or from the env named by ``env`` (its item stream
and held-out set, e.g. tool_math's arithmetic problems).
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.config import TaskConfig
from polyrl.envs.base import Env, Task, TaskContext, env_spec, register_env, task_params
from polyrl.loader import load_object

Agent = Callable[[Any, dict[str, Any]], Any]
"""``async def run(client: openai.AsyncOpenAI, item: dict) -> float | tuple[float, dict]``."""


def load_agent(reference: str, key: str) -> Agent:
    """The agent function a ``module:attr`` names; it must be an async function of (client, item)."""
    agent = load_object(reference, key)
    if not callable(agent):
        raise ValueError(f"{key}: '{reference}' is not callable; it must be: async def run(client, item)")
    call = agent if inspect.isfunction(agent) or inspect.ismethod(agent) else agent.__call__
    if not inspect.iscoroutinefunction(call):
        raise ValueError(f"{key}: '{reference}' must be an async function: async def run(client, item)")
    try:
        inspect.signature(call).bind(None, {})
    except TypeError:
        raise ValueError(f"{key}: '{reference}' must take two arguments (client, item)") from None
    return agent


def read_items(source: list[dict[str, Any]] | str, key: str) -> list[dict[str, Any]]:
    """Items given inline or as a .json (a list) / .jsonl (one object a line) file; errors name the row."""
    if isinstance(source, str):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{key}: no such file '{source}'") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # a directory, a bad name, not UTF-8 text
            raise ValueError(f"{key}: cannot read '{source}': {getattr(exc, 'strerror', None) or exc}") from None
        if path.suffix == ".jsonl":
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{source}: line {n} is not valid JSON ({exc.msg})") from None
        else:
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            if not isinstance(rows, list):
                raise ValueError(f"{source}: a .json items file must hold a list of objects")
        where = source
    else:
        rows, where = source, key
    if not rows:
        raise ValueError(f"{key}: no items")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: item {i} is a {type(row).__name__}, not an object")
    return rows


class AgentTask(Task):
    """A task whose episodes are the user's agent; items from a list (shuffled each pass) or from an env."""

    def __init__(
        self,
        config: TaskConfig,
        agent: Agent,
        seed: int,
        items: list[dict[str, Any]] | None = None,
        eval_items: list[dict[str, Any]] | None = None,
        source: Task | None = None,
    ) -> None:
        super().__init__(config, self._no_env, None, seed)
        self.agent = agent
        self.items, self.held_out, self.source = items, eval_items, source

    def _no_env(self) -> Env:
        raise TypeError(f"task '{self.name}' is an agent task: its episodes run the agent, not an env")

    @property
    def has_eval_items(self) -> bool:
        return self.source is not None or self.held_out is not None

    def train_item(self, index: int) -> dict[str, Any]:
        if self.source is not None:
            return self.source.train_item(index)
        n = len(self.items)
        # Each pass over the items is its own seeded shuffle, so the stream is a pure function of the index.
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + index // n).shuffle(order)
        return self.items[order[index % n]]

    def eval_items(self, n: int | None = None) -> list[dict[str, Any]]:
        if self.source is not None:
            return self.source.eval_items(n)
        if self.held_out is None:
            raise ValueError(f"task '{self.name}': no eval_items; an agent task needs them (or an env) to be "
                             "evaluated")
        return self.held_out[: self.config.eval_size if n is None else n]


def _source_config(config: TaskConfig) -> TaskConfig:
    return config.model_copy(update={"agent": None, "items": None, "eval_items": None})


def _check(config: TaskConfig, key: str) -> None:
    if config.agent is None:
        raise ValueError(f"{key}.env: 'agent' is not an env; name your agent in {key}.agent (module:attr)")
    load_agent(config.agent, f"{key}.agent")
    if config.items is not None:
        if config.env is not None:
            raise ValueError(f"{key}.items: give items or an env to take them from, not both")
        read_items(config.items, f"{key}.items")
        if config.eval_items is not None:
            read_items(config.eval_items, f"{key}.eval_items")
        return
    if config.env is None:
        raise ValueError(f"{key}.items: an agent task needs items (a list or a .json/.jsonl file) or an env")
    if config.eval_items is not None:
        raise ValueError(f"{key}.eval_items: the env '{config.env}' gives the held-out items; leave it unset")
    if config.env == "agent":
        raise ValueError(f"{key}.env: an agent task's env supplies items; 'agent' supplies none")
    spec = env_spec(config.env, f"{key}.env")
    task_params(spec, config, key)  # the env's params are validated here, not at the first rollout
    if spec.check is not None:
        spec.check(_source_config(config), key)


@register_env("agent", check=_check)
def agent_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Your own agent (tasks[].agent: module:attr) on the policy's OpenAI-compatible endpoint."""
    agent = load_agent(config.agent, "task.agent")
    if config.items is not None:
        held_out = read_items(config.eval_items, "task.eval_items") if config.eval_items is not None else None
        return AgentTask(config, agent, ctx.seed, read_items(config.items, "task.items"), held_out)
    spec = env_spec(config.env, "task.env")
    source_cfg = _source_config(config)
    source_ctx = TaskContext(ctx.seed, task_params(spec, source_cfg, "task"), ctx.tool_parser, ctx.system_prompt)
    return AgentTask(config, agent, ctx.seed, source=spec.factory(source_cfg, source_ctx))
