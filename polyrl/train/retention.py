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
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.config import Config
from polyrl.config_check import load_config
from polyrl.train.checkpoint import latest_checkpoint
from polyrl.train.loop import train

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
    """Run the distill stage ``config`` for at most ``budget`` steps, pausing every ``every`` steps to validate,
    until every task's validation accuracy is within ``tolerance`` of its teacher's; returns the kept
    checkpoint, the parts' history, the steps taken and their training time.

    The parts are one run resumed (``train.stop_at_step``): one optimizer state and one learning-rate schedule
    over the budget, so a pause is not a restart of Adam's moments or of the schedule. With ``focus`` each part
    samples the tasks by ``focus_weights`` of the last validation (the sampler's state is its cursors, so a
    new mixture resumes cleanly)."""
    teachers = {t.name: t.teacher for t in config.tasks}
    target = {task: validate(teacher)[task] for task, teacher in teachers.items()}
    history = [{"steps": 0, "checkpoint": config.model.name, "validation": validate(config.model.name)}]
    log(f"{stage_dir.name}: teachers' validation {target}, start {history[0]['validation']}")
    data = config.model_dump(mode="json")
    data["train"].update(steps=budget, keep_checkpoints=budget // every + 1, checkpoint_every=0)
    configured = {t["name"]: t["weight"] for t in data["tasks"]}
    summary: dict[str, Any] = {}
    while worst_gap(history[-1]["validation"], target) < -tolerance and history[-1]["steps"] < budget:
        data["train"]["stop_at_step"] = min(history[-1]["steps"] + every, budget)
        if focus:
            weights = focus_weights(configured, history[-1]["validation"], target, focus)
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
    kept = choose_part(history, target, tolerance)
    return {"checkpoint": history[kept]["checkpoint"], "kept_part": kept, "parts": history,
            "teacher_validation": target, "steps": history[-1]["steps"],
            "train_time_s": summary.get("train_time_s", 0.0)}
