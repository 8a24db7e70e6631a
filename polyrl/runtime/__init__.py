"""Runtimes: where the two halves of a step (``produce_batch``, ``learn_batch``) run (docs/systems.md)."""

from __future__ import annotations

from typing import Any

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
    """The stepper ``run.plan`` calls for, resuming after step ``start``: Ray rollout workers when engines are
    disaggregated (on every learner rank), a rollout process under async, else ``rl_step`` in this process
    (under several colocated ranks each rolls out its share and steps in turn)."""
    if run.plan.disaggregated:
        return RayStepper(run, start)
    if run.plan.runtime == "async":
        return AsyncStepper(run, start)
    return LocalStepper(run)
