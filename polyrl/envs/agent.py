"""Agent tasks: the user's own agent code, ``async def run(client, item) -> reward``, named in the config as
``tasks: [{name: my_agent, agent: "my_pkg.agents:run", items: [...]}]``.

The task holds the agent and its items; it has no env. Its episodes are played by ``polyrl.endpoint.rollout``,
which hands each episode an ``openai.AsyncOpenAI`` client on the policy's endpoint and trains on the calls.
Items come from ``items`` (a dataset file or a list, as for any task: docs/your-data.md) or from the env named
by ``env`` (its item stream and held-out set, e.g. tool_math's arithmetic problems).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from polyrl.config import TaskConfig
from polyrl.data.files import ListRows
from polyrl.data.items import DatasetSource, ItemSource, dataset_source
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


class AgentTask(Task):
    """A task whose episodes are the user's agent; items from ``items`` (a dataset, split and shuffled per
    epoch like any other) or from an env's item source."""

    def __init__(self, config: TaskConfig, agent: Agent, seed: int, items: list[dict[str, Any]] | None = None,
                 source: ItemSource | None = None) -> None:
        if source is None and items is not None:
            source = DatasetSource(ListRows(items, "task.items"), held_out_fraction=0.0, seed=seed)
        super().__init__(config, self._no_env, seed=seed, source=source)
        self.agent = agent

    def _no_env(self) -> Env:
        raise TypeError(f"task '{self.name}' is an agent task: its episodes run the agent, not an env")


def _source_config(config: TaskConfig) -> TaskConfig:
    return config.model_copy(update={"agent": None, "items": None, "eval_items": None})


def _check(config: TaskConfig, key: str) -> None:
    if config.agent is None:
        raise ValueError(f"{key}.env: 'agent' is not an env; name your agent in {key}.agent (module:attr)")
    load_agent(config.agent, f"{key}.agent")
    if config.items is not None:
        if config.env is not None:
            raise ValueError(f"{key}.items: give items or an env to take them from, not both")
        return
    if config.env is None:
        raise ValueError(f"{key}.items: an agent task needs items (a dataset file or a list) or an env")
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
        return AgentTask(config, agent, ctx.seed, source=dataset_source(config, ctx.seed))
    spec = env_spec(config.env, "task.env")
    source_cfg = _source_config(config)
    source_ctx = TaskContext(ctx.seed, task_params(spec, source_cfg, "task"), ctx.tool_parser, ctx.system_prompt)
    return AgentTask(config, agent, ctx.seed, source=spec.factory(source_cfg, source_ctx).source)
