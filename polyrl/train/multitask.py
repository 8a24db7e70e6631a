"""The multi-task features of a step beyond the task mixture: the curriculum's mixture, levels and
observations (``envs/curriculum.py``) and cross-policy sampling (``CrossPolicy``). Weighted reward components
are ``envs/reward_mix.py``'s ``RewardMixer``; task-advantage normalisation is part of ``assign_advantages``."""

from __future__ import annotations

from typing import Any

from polyrl.config import Config, TaskConfig
from polyrl.data.sampler import TaskSampler
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import Task, make_task
from polyrl.envs.curriculum import Curriculum
from polyrl.models.device import model_bf16, resolve_device
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.train.agents import GroupRollout, Requests
from polyrl.types import Trajectory

CROSS_SEED_OFFSET = 500_009  # the other policy's samples draw from their own seeds


def build_curriculum(config: Config, tokenizer: Any) -> Curriculum | None:
    """``config.curriculum``'s state, every level's task built up front; None when off."""
    if not config.curriculum:
        return None
    seed, system = config.train.seed, config.model.system_prompt

    def build(task_config: TaskConfig) -> Task:
        return make_task(task_config, seed, system, tokenizer)

    return Curriculum(config.curriculum, config.tasks, build)


def set_mixture(curriculum: Curriculum | None, sampler: TaskSampler, step: int) -> None:
    """Before a draw: the curriculum's task mixture for ``step`` (its phase, or the adaptive mixture)."""
    if curriculum is not None:
        weights = curriculum.weights(step)
        sampler.weights = [weights[n] for n in sampler.names]


def level_task(curriculum: Curriculum | None, name: str, base: Task) -> Task:
    """The task ``name`` trains on now: its current difficulty level, ``base`` without a curriculum."""
    return base if curriculum is None else curriculum.task(name, base)


def observe_curriculum(curriculum: Curriculum | None, step: int, sampled: list[Trajectory]) -> dict[str, float]:
    """After a step's samples are scored: the curriculum learns from them (levels, pass rates, progress) and
    reports the mixture the step drew from."""
    if curriculum is None:
        return {}
    weights = curriculum.weights(step)  # what ``set_mixture`` set: observing moves the adaptive mixture on
    metrics = curriculum.observe(step, sampled)
    metrics.update({f"curriculum/weight/{n}": w / (sum(weights.values()) or 1) for n, w in weights.items()})
    return metrics


def cross_policy_split(n_groups: int, share: float) -> int:
    """How many of a round's ``n_groups`` groups the other policy samples: ``share`` rounded, and at least
    one group left to the learner's own policy whenever there are two or more."""
    k = round(share * n_groups)
    return min(k, n_groups - 1) if n_groups > 1 else k


def load_cross_engine(config: Config, tokenizer: Any) -> HFEngine:
    """An engine sampling from ``rollout.cross_policy.model``; its vocabulary must be the policy's."""
    name = config.rollout.cross_policy.model
    other_tok = load_tokenizer(name)
    if other_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"rollout.cross_policy.model: '{name}' has a different vocabulary from model.name "
                         f"'{config.model.name}'; token ids would not mean the same")
    device = resolve_device(config.train.device)
    model = load_model(name, None, seed=config.train.seed, device=device).eval().requires_grad_(False)
    return HFEngine(model, tokenizer, bf16=model_bf16(config), bf16_weights=False)


class CrossPolicy:
    """``rollout.cross_policy``: the last ``share`` of each round's groups sampled by another policy's engine
    and flagged (``info["cross_policy"]``) for the learner's truncated importance weights."""

    def __init__(self, config: Config, tokenizer: Any) -> None:
        self.share = config.rollout.cross_policy.share
        self.engine = load_cross_engine(config, tokenizer)

    def split(self, requests: Requests) -> tuple[Requests, Requests]:
        """The round's requests for the learner's policy and for the other one."""
        k = cross_policy_split(len(requests), self.share)
        return requests[: len(requests) - k], requests[len(requests) - k :]

    def roll_out(self, group_rollout: GroupRollout, requests: Requests, seed: int, version: int,
                 first_id: int) -> list[Trajectory]:
        trajectories = group_rollout.roll_out(self.engine, requests, seed + CROSS_SEED_OFFSET, version, first_id)
        for t in trajectories:
            t.info["cross_policy"] = True
        return trajectories

    def metrics(self, sampled: list[Trajectory]) -> dict[str, float]:
        if not sampled:
            return {}
        return {"cross_policy/frac": sum(bool(t.info.get("cross_policy")) for t in sampled) / len(sampled)}
