"""The agent features of ``config.agents`` (docs/agents.md), each one object or function, in the order a step
uses them: ``GroupRollout`` plays the groups (ARPO trees, early stop, agent tasks through the policy's
endpoint), ``Replay`` holds success and prompt replay (checkpointed), ``episode_metrics`` reads ARPO, early
stop and tool calls off the step's episodes (step credit is part of learner/advantage_stage.py). Every feature
is off by default, which leaves plain rollouts."""

from __future__ import annotations

from statistics import mean
from typing import Any

from polyrl.config import AgentsConfig, Config, ReplayConfig
from polyrl.data.replay import PromptReplay, SuccessBuffer
from polyrl.data.sampler import Draw, TaskSampler
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task
from polyrl.rollout.arpo import arpo_rollout
from polyrl.rollout.early_stop import EarlyStopper
from polyrl.rollout.multi_turn import rollout
from polyrl.types import Trajectory

Requests = list[tuple[Task, int, dict[str, Any]]]
"""(task, item index, item) per group."""


def add_metrics(total: dict[str, float], more: dict[str, float]) -> None:
    """Sum ``more`` into ``total`` key by key (counts over a step's sampling rounds)."""
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v


class GroupRollout:
    """Plays one group per request: env tasks through ``rollout/multi_turn.py``, or as ARPO's branching trees
    (``agents.arpo``), cut short by ``agents.early_stop`` when on; agent tasks (``tasks[].agent``) through the
    policy's endpoint. The agent episodes' metrics wait in ``agent_metrics`` until the step reads them."""

    def __init__(self, config: Config) -> None:
        self.sampling = config.rollout
        self.arpo, self.early_stop = config.agents.arpo, config.agents.early_stop
        self.model_name = config.model.name  # what agent tasks' clients call the policy
        self.agent_metrics: dict[str, float] = {}

    def roll_out(self, engine: Any, requests: Requests, seed: int, version: int, first_id: int) -> list[Trajectory]:
        """Group ids run from ``first_id`` in the order of ``requests``, whatever plays each group."""
        is_agent = [isinstance(task, AgentTask) for task, _, _ in requests]
        env_requests = [req for req, agent in zip(requests, is_agent, strict=True) if not agent]
        # Among agent tasks the env groups are numbered from 0, then moved to their places in ``requests``.
        env_first_id = 0 if any(is_agent) else first_id
        out: list[Trajectory] = []
        if env_requests:
            es = self.early_stop
            stopper = EarlyStopper(es.signal, es.alpha, es.threshold, es.min_tokens, es.terminal_reward) \
                if es.enabled else None
            if self.arpo.enabled:
                out = arpo_rollout(engine, env_requests, self.sampling, self.arpo, seed, version, env_first_id,
                                   stopper)
            else:
                out = rollout(engine, env_requests, self.sampling, seed, version, env_first_id, stopper)
        if not any(is_agent):
            return out
        env_ids = [first_id + g for g, agent in enumerate(is_agent) if not agent]
        for t in out:
            t.group_id = env_ids[t.group_id]
        agent_requests = [(task, i, item, first_id + g) for g, ((task, i, item), agent)
                          in enumerate(zip(requests, is_agent, strict=True)) if agent]
        # Imported here: the endpoint (fastapi, uvicorn, openai) loads only in runs that have agent tasks.
        from polyrl.endpoint.rollout import agent_rollout

        trajectories, metrics = agent_rollout(engine, self.model_name, agent_requests, self.sampling, seed, version)
        add_metrics(self.agent_metrics, metrics)
        return out + trajectories

    def take_metrics(self) -> dict[str, float]:
        """The agent episodes' metrics gathered since the last call."""
        metrics, self.agent_metrics = self.agent_metrics, {}
        return metrics


class Replay:
    """``agents.replay``: success replay (a stored success of the same item replaces a sample of an all-fail
    group) and prompt replay (a share of each round drawn among items already seen, favouring pass rates near
    0.5). Its state is the checkpoint's ``agents`` entry."""

    def __init__(self, config: ReplayConfig, seed: int) -> None:
        self.success = SuccessBuffer(config.success_buffer, config.success_score, config.replay_ratio, seed) \
            if config.success_buffer else None
        self.prompts = PromptReplay(config.prompt_replay, config.success_score, seed) \
            if config.prompt_replay else None

    def draw(self, sampler: TaskSampler, step: int, n: int, round_index: int) -> list[Draw]:
        """A round's ``n`` items: fresh ones from the sampler, then prompt replay's share of seen ones."""
        k = self.prompts.count(n) if self.prompts is not None else 0
        fresh = sampler.draw(step, n - k, round_index) if n - k else []
        return fresh + (self.prompts.draw(step, k, round_index) if k else [])

    def mix_in(self, trajectories: list[Trajectory], step: int) -> dict[str, float]:
        """After scoring, before advantages (and before DAPO's filter, so that a mixed-in group counts as
        informative): record pass rates, mix stored successes into all-fail groups (in place)."""
        if self.prompts is not None:
            self.prompts.update(trajectories)
        return self.success.mix_in(trajectories, step) if self.success is not None else {}

    def state_dict(self) -> dict:
        return {
            "success": self.success.state_dict() if self.success is not None else None,
            "prompts": self.prompts.state_dict() if self.prompts is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.success is not None and state.get("success") is not None:
            self.success.load_state_dict(state["success"])
        if self.prompts is not None and state.get("prompts") is not None:
            self.prompts.load_state_dict(state["prompts"])


def episode_metrics(sampled: list[Trajectory], agents: AgentsConfig) -> dict[str, float | None]:
    """ARPO's branch points (when on), early stop's share of episodes and tokens saved (when on), and tool calls
    per solved episode (tool tasks; replayed samples left out)."""
    metrics: dict[str, float | None] = {}
    if agents.arpo.enabled:
        metrics["arpo/branch_points"] = float(sum({t.group_id: t.info.get("arpo_branch_points", 0)
                                                   for t in sampled}.values()))
    if agents.early_stop.enabled:
        metrics["early_stop/frac"] = mean(float(t.terminated_early) for t in sampled)
        metrics["early_stop/tokens_saved"] = float(sum(t.info.get("tokens_saved", 0) for t in sampled))
    if any("tool_calls" in t.info for t in sampled):
        solved = [t for t in sampled if float(t.info.get("score", 0.0)) >= 1.0 and not t.replayed]
        metrics["tool_calls/per_solved"] = mean(t.info.get("tool_calls", 0) for t in solved) if solved else None
    return metrics
