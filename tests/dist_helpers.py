"""Run a function on several gloo ranks of this machine, for the sharded-learner tests: ranks are started
by ``polyrl.parallel.launch`` and join the group as ``polyrl train`` ranks do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from polyrl.parallel.group import join_group, leave_group
from polyrl.parallel.launch import launch_ranks


def _joined(fn: Callable, args: tuple, timeout_s: float) -> None:
    join_group("gloo", timeout_s, torch.device("cpu"))
    try:
        fn(*args)
    finally:
        leave_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout_s: float = 120.0) -> None:
    """``fn(*args)`` on ``world_size`` gloo ranks (collectives time out after ``timeout_s``); raises
    ``RankFailedError`` if any rank fails."""
    launch_ranks(world_size, torch.device("cpu"), _joined, fn, args, timeout_s)
