"""Runtimes: where the two halves of a step (``produce_batch``, ``learn_batch``) run (docs/systems.md)."""

from __future__ import annotations

from typing import Any

from polyrl.config import engines_of
from polyrl.parallel.group import current
from polyrl.runtime.async_ import AsyncStepper
from polyrl.runtime.ray_ import RayStepper
from polyrl.runtime.stepper import Stepper, producer_state
from polyrl.train.step import rl_step


class LocalStepper:
    """The synchronous runtime: ``rl_step`` in this process."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def step(self, step: int):
        return rl_step(self.run, step)

    def producer_state(self) -> dict[str, Any]:
        return producer_state(self.run)

    def close(self) -> None:
        pass


def make_stepper(run: Any, start: int) -> Stepper:
    """The stepper of ``run.config.runtime.kind``, resuming after step ``start``."""
    kind = run.config.runtime.kind
    if kind == "ray" and engines_of(run.config) == "disaggregated":  # on every learner rank
        return RayStepper(run, start)
    if current().distributed:  # every rank rolls out its share and steps in turn
        return LocalStepper(run)
    if kind == "async":
        return AsyncStepper(run, start)
    return LocalStepper(run)
