"""The agent features of ``config.agents`` as the loop sees them: where each hooks into a step, and their
checkpointed state. Every feature is off by default; with all off each hook is a no-op (plain rollouts)."""

from __future__ import annotations

from statistics import mean
from typing import Any

from polyrl.config import Config, RolloutConfig
from polyrl.data.replay import PromptReplay, SuccessBuffer
from polyrl.data.sampler import Draw, TaskSampler
from polyrl.endpoint.rollout import agent_rollout
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task
from polyrl.rollout.arpo import arpo_rollout
from polyrl.rollout.early_stop import EarlyStopper
from polyrl.rollout.multi_turn import rollout
from polyrl.types import Trajectory


class AgentFeatures:
    def __init__(self, config: Config) -> None:
        self.cfg = config.agents
        rp, seed = self.cfg.replay, config.train.seed
        self.success = SuccessBuffer(rp.success_buffer, rp.success_score, rp.replay_ratio, seed) \
            if rp.success_buffer else None
        self.prompts = PromptReplay(rp.prompt_replay, rp.success_score, seed) if rp.prompt_replay else None
        self.pending: dict[str, float] = {}  # replay and agent-task metrics summed over a step's sampling rounds
        self.model_name = config.model.name  # what agent tasks' clients call the policy

    # 1. which items a step draws
    def draw(self, sampler: TaskSampler, step: int, n: int, round_index: int) -> list[Draw]:
        k = self.prompts.count(n) if self.prompts is not None else 0
        fresh = sampler.draw(step, n - k, round_index) if n - k else []
        return fresh + (self.prompts.draw(step, k, round_index) if k else [])

    # 2. how a group is rolled out
    def rollout(
        self, engine: Any, requests: list[tuple[Task, int, dict[str, Any]]], r: RolloutConfig, seed: int,
        version: int, first_id: int,
    ) -> list[Trajectory]:
        """Env tasks through the rollout below; agent tasks (``tasks[].agent``) through the policy's endpoint.
        Group ids follow the order of ``requests`` either way."""
        ids = list(range(first_id, first_id + len(requests)))
        agent = [(task, i, item, gid) for (task, i, item), gid in zip(requests, ids, strict=True)
                 if isinstance(task, AgentTask)]
        if not agent:
            return self._env_rollout(engine, requests, r, seed, version, first_id)
        env_requests = [req for req in requests if not isinstance(req[0], AgentTask)]
        env_ids = [gid for req, gid in zip(requests, ids, strict=True) if not isinstance(req[0], AgentTask)]
        out = self._env_rollout(engine, env_requests, r, seed, version, 0) if env_requests else []
        for t in out:
            t.group_id = env_ids[t.group_id]
        trajectories, metrics = agent_rollout(engine, self.model_name, agent, r.group_size, r.max_new_tokens,
                                              r.temperature, r.top_p, seed, version)
        for k, v in metrics.items():
            self.pending[k] = self.pending.get(k, 0.0) + v
        return out + trajectories

    def _env_rollout(
        self, engine: Any, requests: list[tuple[Task, int, dict[str, Any]]], r: RolloutConfig, seed: int,
        version: int, first_id: int,
    ) -> list[Trajectory]:
        es = self.cfg.early_stop
        stopper = EarlyStopper(es.signal, es.alpha, es.threshold, es.min_tokens, es.terminal_reward) \
            if es.enabled else None
        if self.cfg.arpo.enabled:
            return arpo_rollout(engine, requests, r.group_size, r.max_new_tokens, r.temperature, r.top_p, seed,
                                version, self.cfg.arpo, first_id, stopper)
        return rollout(engine, requests, r.group_size, r.max_new_tokens, r.temperature, r.top_p, seed=seed,
                       version=version, first_group_id=first_id, stopper=stopper)

    # 3. after scoring, before advantages (and before DAPO's filter, so a mixed-in group counts as informative)
    def after_rollout(self, trajectories: list[Trajectory], step: int) -> None:
        if self.prompts is not None:
            self.prompts.update(trajectories)
        if self.success is not None:
            for k, v in self.success.mix_in(trajectories, step).items():
                self.pending[k] = self.pending.get(k, 0.0) + v

    # 4. after the advantages (train/advantage_stage.py, which also does step credit and ARPO attribution)
    def after_advantages(self, kept: list[Trajectory], sampled: list[Trajectory]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.cfg.arpo.enabled:
            metrics["arpo/branch_points"] = float(sum({t.group_id: t.info.get("arpo_branch_points", 0)
                                                       for t in sampled}.values()))
        if self.cfg.early_stop.enabled:
            metrics["early_stop/frac"] = mean(float(t.terminated_early) for t in sampled)
            metrics["early_stop/tokens_saved"] = float(sum(t.info.get("tokens_saved", 0) for t in sampled))
        if any("tool_calls" in t.info for t in sampled):
            solved = [t for t in sampled if float(t.info.get("score", 0.0)) >= 1.0 and not t.replayed]
            metrics["tool_calls/per_solved"] = mean(t.info.get("tool_calls", 0) for t in solved) if solved else None
        metrics.update(self.pending)
        self.pending = {}
        return metrics

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
