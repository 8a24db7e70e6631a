"""The step interface the training loop calls on every runtime, the producing half's state a checkpoint keeps,
and the host copy of the policy's weights a runtime hands to another process."""

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
    sampler's draws, the replay buffers (``agents``), the curriculum (``multitask``) and the prompt selector's
    pass-rate estimates (``selection``). A producer that runs ahead of the learner sends it with each batch, so
    that a checkpoint keeps the state after the batch it trained on, not after those drawn since."""
    curriculum = {"curriculum": run.curriculum.state_dict()} if run.curriculum is not None else {}
    selection = {"selection": run.selection.state_dict()} if run.selection is not None else {}
    return copy.deepcopy({"sampler": run.sampler.state_dict(), "agents": run.replay.state_dict(),
                          "multitask": curriculum, **selection})


def load_producer_state(run: Any, state: dict[str, Any]) -> None:
    run.sampler.load_state_dict(state["sampler"])
    run.replay.load_state_dict(state.get("agents", {}))
    if run.curriculum is not None and "curriculum" in state.get("multitask", {}):
        run.curriculum.load_state_dict(state["multitask"]["curriculum"])
    if run.selection is not None and "selection" in state:
        run.selection.load_state_dict(state["selection"])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of ``model``'s state: the learner keeps updating its tensors in place while another process
    reads this one, and a GPU learner's tensors cannot cross to a process without a CUDA context of its own."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
