"""Keeping earlier domains through a cascade: replay with retention KL in RL stages, early-stopped distillation.

Two mechanisms on top of Cascade RL's stages (Wang et al. 2025, "Nemotron-Cascade"), chosen for the pipeline
in docs/multidomain.md:

- replay: an RL stage also samples a share of prompts from the tasks that earlier stages trained, and on those
  rows adds the reverse KL to each task's best checkpoint (on-policy distillation, Agarwal et al. 2024,
  interleaved with RL as in multi-teacher on-policy distillation). The policy gradient still applies to every
  row, so earlier domains keep being practised against their own reward.
- early stopping: a distill stage pauses every ``eval_every`` steps and stops once every task's accuracy on
  validation items (disjoint from the reported held-out items) is within ``until_within`` of its teacher's,
  or its step budget ends; it keeps the part (possibly the start) whose worst gap to the teachers is smallest.
  With ``focus`` each part samples the tasks furthest behind their teachers more.
- keeping the best part: an RL stage with ``keep_best`` is validated every ``eval_every`` steps on every
  task and ends at the part (possibly the start) with the highest mean validation accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.checkpoint.store import latest_checkpoint
from polyrl.config import Config
from polyrl.config_check import load_config
from polyrl.run.loop import train

# Validation items come from the tasks' held-out generator under seed + this offset: reasoning-gym item i of
# seed s is generated from s + i, so with eval_size below the offset they never coincide with reported items.
VALIDATION_SEED_OFFSET = 1_000_003


def replay_weights(own: dict[str, float], replayed: list[str], share: float) -> dict[str, float]:
    """Sampling weights of the stage's own tasks and the replayed ones: the replayed tasks together get
    ``share`` of the mass, split evenly; the own tasks keep their relative weights."""
    if not replayed or share <= 0:
        return dict(own)
    total = sum(own.values())
    each = share * total / ((1 - share) * len(replayed))
    return {**own, **{name: each for name in replayed}}


def worst_gap(accuracy: dict[str, float], target: dict[str, float]) -> float:
    """The smallest accuracy - target over the tasks of ``target`` (negative: some task is below its target)."""
    return min(accuracy[t] - target[t] for t in target)


def choose_part(history: list[dict[str, Any]], target: dict[str, float], tolerance: float) -> int:
    """Index of the part to keep: the first within ``tolerance`` of every target, else the best worst gap
    (the earliest on a tie)."""
    for i, part in enumerate(history):
        if worst_gap(part["validation"], target) >= -tolerance:
            return i
    gaps = [worst_gap(part["validation"], target) for part in history]
    return gaps.index(max(gaps))


def focus_weights(weights: dict[str, float], accuracy: dict[str, float], target: dict[str, float],
                  focus: float) -> dict[str, float]:
    """Sampling weights that favour the tasks furthest below their targets: each weight times 1 + ``focus`` x
    the task's shortfall in points (none for a task at or above its target)."""
    return {t: w * (1 + focus * 100 * max(0.0, target[t] - accuracy[t])) for t, w in weights.items()}


def validation_config(config: Config) -> Config:
    """``config`` evaluating ``pipeline.validation_size`` items per task from the validation seed."""
    data = config.model_dump(mode="json")
    data["train"]["seed"] = config.train.seed + VALIDATION_SEED_OFFSET
    for task in data["tasks"]:
        task["eval_size"] = config.pipeline.validation_size
    return load_config("validation", data=data)


def train_in_parts(
    config: Config,
    stage_dir: Path,
    budget: int,
    every: int,
    validate: Callable[[str], dict[str, float]],
    done: Callable[[dict[str, float]], bool],
    choose: Callable[[list[dict[str, Any]]], int],
    reweight: Callable[[dict[str, float]], dict[str, float]] | None = None,
    run_part: Callable[..., dict[str, Any]] = train,
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the stage ``config`` for at most ``budget`` steps, pausing every ``every`` steps to validate, until
    ``done(validation)``; returns the checkpoint of the part ``choose(parts)`` keeps (the start is part 0), the
    parts' history, the steps taken and their training time.

    The parts are one run resumed (``train.stop_at_step``): one optimizer state and one learning-rate schedule
    over the budget, so a pause is not a restart of Adam's moments or of the schedule. With ``reweight`` each
    part samples the tasks by the weights it gives for the last validation (the sampler's state is its
    cursors, so a new mixture resumes cleanly)."""
    history = [{"steps": 0, "checkpoint": config.model.name, "validation": validate(config.model.name)}]
    data = config.model_dump(mode="json")
    data["train"].update(steps=budget, keep_checkpoints=budget // every + 1, checkpoint_every=0)
    summary: dict[str, Any] = {}
    while not done(history[-1]["validation"]) and history[-1]["steps"] < budget:
        data["train"]["stop_at_step"] = min(history[-1]["steps"] + every, budget)
        if reweight is not None:
            weights = reweight(history[-1]["validation"])
            for t in data["tasks"]:
                t["weight"] = weights[t["name"]]
            history[-1]["next_weights"] = weights
        part = load_config(stage_dir.name, data=data)
        summary = run_part(part, stage_dir, resume=len(history) > 1 or (resume and stage_dir.exists()), log=log)
        ckpt = latest_checkpoint(stage_dir)
        if ckpt is None:
            raise RuntimeError(f"{stage_dir}: finished without a checkpoint")
        history.append({"steps": summary["steps"], "checkpoint": str(ckpt), "validation": validate(str(ckpt))})
        log(f"{stage_dir.name}: after {summary['steps']} steps, validation {history[-1]['validation']}")
    kept = choose(history)
    return {"checkpoint": history[kept]["checkpoint"], "kept_part": kept, "parts": history,
            "steps": history[-1]["steps"], "train_time_s": summary.get("train_time_s", 0.0)}


def distill_until_within(
    config: Config,
    stage_dir: Path,
    budget: int,
    every: int,
    tolerance: float,
    validate: Callable[[str], dict[str, float]],
    focus: float = 0.0,
    run_part: Callable[..., dict[str, Any]] = train,
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The distill stage ``config`` in parts (``train_in_parts``) until every task's validation accuracy is
    within ``tolerance`` of its teacher's; keeps the first part that is, else the one that falls least short.
    With ``focus`` each part samples the tasks by ``focus_weights`` of the last validation."""
    teachers = {t.name: t.teacher for t in config.tasks}
    target = {task: validate(teacher)[task] for task, teacher in teachers.items()}
    log(f"{stage_dir.name}: teachers' validation {target}, start {validate(config.model.name)}")
    configured = {t.name: t.weight for t in config.tasks}
    result = train_in_parts(
        config, stage_dir, budget, every, validate,
        done=lambda accuracy: worst_gap(accuracy, target) >= -tolerance,
        choose=lambda parts: choose_part(parts, target, tolerance),
        reweight=(lambda accuracy: focus_weights(configured, accuracy, target, focus)) if focus else None,
        run_part=run_part, resume=resume, log=log)
    return {**result, "teacher_validation": target}


def best_mean_part(history: list[dict[str, Any]]) -> int:
    """Index of the part with the highest mean validation accuracy over its tasks (the earliest on a tie)."""
    means = [sum(part["validation"].values()) / len(part["validation"]) for part in history]
    return means.index(max(means))


def rl_keep_best(
    config: Config,
    stage_dir: Path,
    steps: int,
    every: int,
    validate: Callable[[str], dict[str, float]],
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The RL stage ``config``, all its ``steps``, validated every ``every`` steps on every task of the
    pipeline; keeps the part (the start included) with the highest mean validation accuracy, so a stage
    that gains its own domain by losing more on the others ends where the trade was best."""
    log(f"{stage_dir.name}: start {validate(config.model.name)}")
    return train_in_parts(config, stage_dir, steps, every, validate, done=lambda accuracy: False,
                          choose=best_mean_part, resume=resume, log=log)
