"""The multi-task features as the loop sees them: curricula (task phases, difficulty levels, adaptive
mixture), weighted reward components (env + LLM-as-judge) and cross-policy sampling. Each is off by default;
with all off every hook is a no-op. Task-advantage normalisation is part of ``assign_advantages``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyrl.config import Config, TaskConfig
from polyrl.data.curriculum import Curriculum
from polyrl.data.sampler import TaskSampler
from polyrl.envs.base import Task, make_task
from polyrl.rewards.mix import RewardMixer
from polyrl.types import Trajectory

Requests = list[tuple[Task, int, dict[str, Any]]]
RolloutOn = Callable[[Any, Requests, int, int, int], list[Trajectory]]
"""``rollout_on(engine, requests, seed, version, first_group_id)``."""

CROSS_SEED_OFFSET = 500_009  # the other policy's samples draw from their own seeds


def cross_policy_split(n_groups: int, share: float) -> int:
    """How many of a round's ``n_groups`` groups the other policy samples: ``share`` rounded, and at least
    one group left to the learner's own policy whenever there are two or more."""
    k = round(share * n_groups)
    return min(k, n_groups - 1) if n_groups > 1 else k


def load_cross_engine(config: Config, tokenizer: Any) -> Any:
    """An engine sampling from ``rollout.cross_policy.model``; its vocabulary must be the policy's."""
    from polyrl.engines.hf import HFEngine
    from polyrl.models.device import resolve_device
    from polyrl.models.loading import load_model, load_tokenizer

    name = config.rollout.cross_policy.model
    other_tok = load_tokenizer(name)
    if other_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"rollout.cross_policy.model: '{name}' has a different vocabulary from model.name "
                         f"'{config.model.name}'; token ids would not mean the same")
    device = resolve_device(config.train.device)
    model = load_model(name, None, seed=config.train.seed, device=device).eval().requires_grad_(False)
    return HFEngine(model, tokenizer, bf16=config.model.bf16, bf16_weights=False)


class MultiTask:
    def __init__(self, config: Config, tasks: dict[str, Task], tokenizer: Any) -> None:
        self.config = config
        seed, system = config.train.seed, config.model.system_prompt

        def build(task_config: TaskConfig) -> Task:
            return make_task(task_config, seed, system, tokenizer)

        self.curriculum = Curriculum(config.curriculum, config.tasks, build) if config.curriculum else None
        self.mixer = RewardMixer(tasks, tokenizer, config.model.name, seed, device=config.train.device)
        cp = config.rollout.cross_policy
        self.cross_engine = load_cross_engine(config, tokenizer) if cp is not None and cp.share > 0 else None
        self.weights: dict[str, float] = {}

    # 1. the mixture and the training task (its current difficulty level) for a step's draws
    def before_draw(self, sampler: TaskSampler, step: int) -> None:
        if self.curriculum is not None:
            self.weights = self.curriculum.weights(step)
            sampler.weights = [self.weights[n] for n in sampler.names]

    def task(self, name: str, base: Task) -> Task:
        return base if self.curriculum is None else self.curriculum.task(name, base)

    # 2. rollouts: a share of the groups from the other policy, flagged for truncated IS in the learner
    def rollout(
        self, rollout_fn: Callable[[Requests, int, int, int], list[Trajectory]], rollout_on: RolloutOn,
        requests: Requests, seed: int, version: int, first_id: int,
    ) -> list[Trajectory]:
        if self.cross_engine is None:
            return rollout_fn(requests, seed, version, first_id)
        k = cross_policy_split(len(requests), self.config.rollout.cross_policy.share)
        own = rollout_fn(requests[: len(requests) - k], seed, version, first_id) if len(requests) > k else []
        other = rollout_on(self.cross_engine, requests[len(requests) - k :], seed + CROSS_SEED_OFFSET, version,
                           first_id + len(requests) - k) if k else []
        for t in other:
            t.info["cross_policy"] = True
        return own + other

    # 3. after scoring: weighted reward components
    def after_rollout(self, trajectories: list[Trajectory], requests: Requests, first_id: int) -> None:
        if self.mixer.active:
            self.mixer.apply(trajectories, {first_id + g: item for g, (_, _, item) in enumerate(requests)})

    # 4. after the step's samples are scored: the curriculum learns from them
    def observe(self, step: int, sampled: list[Trajectory]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.curriculum is not None:
            metrics.update(self.curriculum.observe(step, sampled))
            metrics.update({f"curriculum/weight/{n}": w / (sum(self.weights.values()) or 1)
                            for n, w in self.weights.items()})
        if self.cross_engine is not None and sampled:
            metrics["cross_policy/frac"] = sum(bool(t.info.get("cross_policy")) for t in sampled) / len(sampled)
        return metrics

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()} if self.curriculum is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
