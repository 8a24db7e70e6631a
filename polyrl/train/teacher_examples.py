"""SFT examples sampled from teachers and kept only when the task's reward scores them correct.

Sequence-level distillation (Kim & Rush 2016, "Sequence-Level Knowledge Distillation") filtered by the
reward, as in rejection-sampling fine-tuning (Yuan et al. 2023, "Scaling Relationship on Learning
Mathematical Reasoning with Large Language Models"): each task's teacher plays ``rollout.group_size`` episodes
per drawn item at the rollout's temperature, and its fully correct episodes (score 1), each distinct reply
once, are the examples. Unlike gold answers these are replies in the teacher's own words and format, so a
student from the same lineage is pulled back toward what the teacher did when it was right, and any task with
a reward has them, gold completions or not (multi-turn episodes included: loss on the model's turns only).
"""

from __future__ import annotations

from typing import Any

from polyrl.config import Config
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import Task
from polyrl.models.device import engine_bf16, model_bf16, resolve_device
from polyrl.models.loading import load_model
from polyrl.rollout.multi_turn import rollout
from polyrl.types import Trajectory


def correct_distinct(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The fully correct trajectories (score 1), each distinct token sequence of an item once."""
    seen: set[tuple[str, int, tuple[int, ...]]] = set()
    kept = []
    for t in trajectories:
        key = (t.task, t.item_id, tuple(t.input_ids))
        if t.info.get("score", t.reward) >= 1.0 and key not in seen:
            seen.add(key)
            kept.append(t)
    return kept


class TeacherExamples:
    """One sampling engine per distinct ``tasks[].teacher`` of ``config``; ``examples`` gives a step's SFT
    examples from them."""

    def __init__(self, config: Config, tokenizer: Any) -> None:
        missing = [t.name for t in config.tasks if not t.teacher]
        if missing and len(missing) < len(config.tasks):
            raise ValueError(f"tasks.{missing[0]}.teacher: an sft run trains every task on its teacher's replies "
                             "or every task on gold answers; set a teacher for each task or for none")
        self.config = config
        self.engines: dict[str, HFEngine] = {}
        device = resolve_device(config.train.device)
        for t in config.tasks:
            if t.teacher and t.teacher not in self.engines:
                model = load_model(t.teacher, None, seed=config.train.seed, device=device).eval()
                self.engines[t.teacher] = HFEngine(model, tokenizer, bf16=model_bf16(config),
                                                   bf16_weights=engine_bf16(config))
        self.teacher = {t.name: t.teacher for t in config.tasks if t.teacher}

    def __bool__(self) -> bool:
        return bool(self.engines)

    def examples(self, requests: list[tuple[Task, int, dict[str, Any]]], seed: int) -> tuple[list[Trajectory], int]:
        """The teachers' correct, distinct episodes on ``requests`` (task, item index, item), and how many
        episodes were sampled."""
        kept: list[Trajectory] = []
        sampled = 0
        for teacher, engine in self.engines.items():
            mine = [r for r in requests if self.teacher[r[0].name] == teacher]
            if not mine:
                continue
            played = rollout(engine, mine, self.config.rollout, seed, version=-1)
            sampled += len(played)
            kept += correct_distinct(played)
        return kept, sampled
