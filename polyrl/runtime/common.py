"""What every runtime shares: the step interface the training loop calls, and the staleness record."""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from polyrl.types import Trajectory


class Stepper(Protocol):
    """One training step at a time: ``step(s)`` returns step s's metrics and the trajectories it trained on;
    ``producer_state()`` is what a checkpoint after that step keeps of the producing half (``producer_state``)."""

    def step(self, step: int) -> tuple[dict[str, Any], list[Trajectory]]: ...

    def producer_state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def producer_state(run: Any) -> dict[str, Any]:
    """What the producing half carries from one step to the next, which a resumed run must get back: the task
    sampler's draws, the replay buffers (``agents``) and the curriculum (``multitask``). A producer that runs
    ahead of the learner sends it with each batch, so that a checkpoint keeps the state after the batch it
    trained on, not after those drawn since."""
    curriculum = {"curriculum": run.curriculum.state_dict()} if run.curriculum is not None else {}
    return copy.deepcopy({"sampler": run.sampler.state_dict(), "agents": run.replay.state_dict(),
                          "multitask": curriculum})


def load_producer_state(run: Any, state: dict[str, Any]) -> None:
    run.sampler.load_state_dict(state["sampler"])
    run.replay.load_state_dict(state.get("agents", {}))
    if run.curriculum is not None and "curriculum" in state.get("multitask", {}):
        run.curriculum.load_state_dict(state["multitask"]["curriculum"])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of ``model``'s state: the learner keeps updating its tensors in place while another process
    reads this one, and a GPU learner's tensors cannot cross to a process without a CUDA context of its own."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def staleness_metrics(trajectories: list[Trajectory], learner_version: int) -> dict[str, float]:
    """Version lag of the trained tokens (learner version minus the version that sampled each model token),
    and the share of trajectories whose tokens span several versions (partial rollouts)."""
    lags: list[int] = []
    mixed = 0
    for t in trajectories:
        versions = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        lags += [learner_version - v for v in versions]
        mixed += len(set(versions)) > 1
    return {
        "staleness/mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness/max": float(max(lags, default=0)),
        "staleness/mixed_version_frac": mixed / len(trajectories) if trajectories else 0.0,
    }


def check_staleness(trajectories: list[Trajectory], learner_version: int, eta: int, where: str) -> None:
    """Raise if any trained token was sampled by a policy older than ``learner_version - eta``."""
    oldest = min((v for t in trajectories for v, m in zip(t.versions, t.loss_mask, strict=True) if m), default=None)
    if oldest is not None and oldest < learner_version - eta:
        raise RuntimeError(
            f"{where}: a token of policy version {oldest} reached learner version {learner_version}, "
            f"beyond runtime.eta={eta}"
        )
