"""Curricula over tasks: a declared task order (phases), difficulty that rises with the pass rate, and a
mixture that adapts online to each task's learning progress.

The decisions are pure functions of the curriculum's state (recent pass flags, recent mean rewards, levels);
``Curriculum`` holds that state, sets the sampler's weights before each step and is updated from each step's
scored samples. The state is plain lists and ints, saved in checkpoints, so a resumed run makes exactly the
choices an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polyrl.config import CurriculumConfig, PhaseConfig, TaskConfig
from polyrl.envs.base import Task
from polyrl.types import Trajectory


def phase_weights(phases: Sequence[PhaseConfig], step: int, default: dict[str, float]) -> dict[str, float]:
    """The mixture of the phase ``step`` falls in (the last phase runs on past its end); tasks a phase leaves
    out get weight 0. No phases: ``default``."""
    if not phases:
        return dict(default)
    phase = next((p for p in phases if step <= p.until_step), phases[-1])
    return {name: float(phase.weights.get(name, 0.0)) for name in default}


def learning_progress(rewards: Sequence[float]) -> float:
    """Absolute least-squares slope of a task's recent per-step mean rewards, in reward per observation
    (the learning-progress signal of Matiisen et al. 2017, "Teacher-Student Curriculum Learning"). Fewer than
    two points carry no slope: 0."""
    n = len(rewards)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(rewards) / n
    cov = sum((i - x_mean) * (r - y_mean) for i, r in enumerate(rewards))
    var = sum((i - x_mean) ** 2 for i in range(n))
    return abs(cov / var)


def progress_mixture(progress: dict[str, float], floor: float) -> dict[str, float]:
    """Mixture weights proportional to learning progress, with ``floor`` of the mass spread evenly
    (Matiisen et al. 2017's proportional teacher with epsilon exploration); no progress anywhere is uniform."""
    k, total = len(progress), sum(progress.values())
    if total <= 0:
        return {name: 1.0 / k for name in progress}
    return {name: floor / k + (1.0 - floor) * p / total for name, p in progress.items()}


def pass_rate(passes: Sequence[bool]) -> float | None:
    return sum(passes) / len(passes) if passes else None


def should_promote(passes: Sequence[bool], window: int, threshold: float) -> bool:
    """Move up a level once a full window of recent samples passes at more than ``threshold``."""
    return len(passes) >= window and sum(passes[-window:]) / window > threshold


def level_config(config: TaskConfig, levels: Sequence[dict[str, Any]], level: int) -> TaskConfig:
    """The task's config at ``level``: level 0 is as configured, level k merges ``levels[k - 1]`` over its
    params (so ``levels`` lists the steps above the configured difficulty)."""
    if level == 0:
        return config
    return config.model_copy(update={"params": {**config.params, **levels[level - 1]}})


class Curriculum:
    """The curriculum's state and its hooks into the loop: ``weights(step)`` before the draw, ``task(name)``
    for the current level's training task, ``observe(step, samples)`` after scoring."""

    def __init__(
        self,
        cfg: CurriculumConfig,
        tasks: Sequence[TaskConfig],
        build_task: Callable[[TaskConfig], Task],
    ) -> None:
        """``build_task`` makes a Task from a (level-adjusted) task config; every level is built up front so
        bad level params fail before training."""
        self.cfg = cfg
        self.base_weights = {t.name: t.weight for t in tasks}
        self.level_tasks: dict[str, list[Task]] = {}
        for t in tasks:
            levels = cfg.levels.get(t.name, [])
            self.level_tasks[t.name] = [build_task(level_config(t, levels, k)) for k in range(1, len(levels) + 1)]
        self.levels = {t.name: 0 for t in tasks}
        self.passes: dict[str, list[bool]] = {t.name: [] for t in tasks}
        self.rewards: dict[str, list[float]] = {t.name: [] for t in tasks}

    def task(self, name: str, base: Task) -> Task:
        """The training task at ``name``'s current level (``base``, the configured one, at level 0)."""
        level = self.levels[name]
        return base if level == 0 else self.level_tasks[name][level - 1]

    def weights(self, step: int) -> dict[str, float]:
        base = phase_weights(self.cfg.phases, step, self.base_weights)
        if not self.cfg.adaptive:
            return base
        if any(len(r) < 2 for r in self.rewards.values()):
            # Warm-up: the declared mixture, with the floor so that every task gathers history.
            total = sum(base.values())
            k = len(base)
            return {n: self.cfg.floor / k + (1 - self.cfg.floor) * w / total for n, w in base.items()}
        return progress_mixture(self.progress(), self.cfg.floor)

    def progress(self) -> dict[str, float]:
        return {n: learning_progress(r[-self.cfg.progress_window :]) for n, r in self.rewards.items()}

    def observe(self, step: int, samples: Sequence[Trajectory]) -> dict[str, float]:
        """Record a step's scored samples (everything rolled out); promote tasks whose pass rate is high.
        Returns the curriculum's metrics for the step."""
        del step  # the state is per observation; the step is implicit in the order of calls
        cfg = self.cfg
        for name in self.levels:
            mine = [t for t in samples if t.task == name]
            if not mine:
                continue
            self.rewards[name] = (self.rewards[name] + [sum(t.reward for t in mine) / len(mine)])[
                -cfg.progress_window :
            ]
            passes = self.passes[name] + [float(t.info.get("score", t.reward)) >= 1.0 for t in mine]
            self.passes[name] = passes[-cfg.pass_window :]
            if self.levels[name] < len(self.level_tasks[name]) and should_promote(
                self.passes[name], cfg.pass_window, cfg.promote_at
            ):
                self.levels[name] += 1
                self.passes[name] = []  # the pass rate at the new level starts afresh
        metrics: dict[str, float] = {}
        progress = self.progress()
        for name in self.levels:
            metrics[f"curriculum/level/{name}"] = float(self.levels[name])
            rate = pass_rate(self.passes[name])
            if rate is not None:
                metrics[f"curriculum/pass_rate/{name}"] = rate
            if cfg.adaptive:
                metrics[f"curriculum/progress/{name}"] = progress[name]
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"levels": dict(self.levels), "passes": {k: list(v) for k, v in self.passes.items()},
                "rewards": {k: list(v) for k, v in self.rewards.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("levels", "passes", "rewards"):
            unknown = set(state[key]) - set(self.levels)
            if unknown:
                raise ValueError(f"checkpoint curriculum.{key}: tasks {sorted(unknown)} are not in this config")
        self.levels.update(state["levels"])
        self.passes.update({k: list(v) for k, v in state["passes"].items()})
        self.rewards.update({k: list(v) for k, v in state["rewards"].items()})
