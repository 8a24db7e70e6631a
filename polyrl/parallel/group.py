"""The learner's process group: which rank this process is, collectives with a timeout, and how a step's
work is split over ranks (contiguous shards of rollout requests, trajectories balanced by tokens)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polyrl.plan import Ranks
from polyrl.waits import WaitTimeoutError, is_timeout

SHARD_SEED_STRIDE = 104_729
"""Shard k of a step's rollout groups samples from seed + k * stride (shard 0 keeps the seed)."""


class RankFailedError(RuntimeError):
    """A learner rank died or a collective timed out."""


def current() -> Ranks:
    """The ranks of the initialised process group, or a single process: asked once, by ``join_group`` (and by
    tests); the run passes its ``RunPlan.ranks`` to everything else."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def backend_for(backend: str, device: torch.device) -> str:
    """``learner.backend``: auto is NCCL on CUDA devices and gloo on the CPU. NCCL comes with gloo beside it for
    host tensors: the ranks also exchange small Python objects and numbers (trajectories, metrics, step times)."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def join_group(backend: str, timeout_s: float, device: torch.device) -> Ranks:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK; torchrun sets the same). A collective that waits past ``timeout_s`` raises
    instead of hanging, so a dead rank ends the run."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RankFailedError(f"learner.world_size > 1 needs the launcher's environment; {key} is not set")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        world, address = os.environ["WORLD_SIZE"], f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group(backend_for(backend, device), timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if not is_timeout(exc):
                raise
            raise WaitTimeoutError(f"all {world} learner ranks to join the process group at {address}", timeout_s,
                                   "learner.timeout_s", "a rank did not start or hangs before joining") from None
    global _timeout_s
    _timeout_s = timeout_s
    return current()


_timeout_s = 0.0
"""The joined group's timeout (``learner.timeout_s``), for the line a timed-out collective ends the run with."""


def collective_timeout(exc: BaseException, rank: int) -> WaitTimeoutError | None:
    """The one line for ``exc`` if it is a collective of the learners' group that timed out, else None."""
    if not is_timeout(exc) or not _timeout_s:
        return None
    return WaitTimeoutError(f"the other learner ranks in a collective (rank {rank})", _timeout_s,
                            "learner.timeout_s", "a rank died or hangs")


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(ranks: Ranks, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if not ranks.distributed:
        return [obj]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(ranks: Ranks, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself in one process; other ranks may pass None)."""
    if not ranks.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_max(ranks: Ranks, value: float) -> float:
    """The largest ``value`` over ranks."""
    if not ranks.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


def contiguous_shards(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of ``n`` items over ``parts`` shards, earlier shards one larger; empty ones kept, so
    shard k is always part k."""
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + base + (k < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def balanced_shards(costs: list[int], parts: int) -> list[list[int]]:
    """Indices of ``costs`` split into ``parts`` shards of about equal total cost (longest first, each to the
    lightest shard so far); each shard keeps its indices in ascending order. Deterministic, so every rank
    computes the same split."""
    loads = [0] * parts
    shards: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(parts), key=lambda k: (loads[k], len(shards[k]), k))
        shards[k].append(i)
        loads[k] += costs[i]
    return [sorted(s) for s in shards]


SAME_ON_EVERY_RANK = ("grad_norm", "skipped_updates")
"""Update metrics every rank computes whole (the gradient norm is the whole batch's)."""


def merge_rank_metrics(ranks: Ranks, totals: dict, means: dict) -> tuple[dict, dict]:
    """One update's metrics over all ranks: each rank's sums (and shares of averages) add up, ``*/max`` and
    ``*/min`` take the extreme, ``SAME_ON_EVERY_RANK`` is taken as it is; None where no rank measured it."""
    gathered = all_gather_objects(ranks, (totals, means))
    out: list[dict] = []
    for part in (0, 1):
        merged: dict = {}
        for key in {k for g in gathered for k in g[part]}:
            values = [g[part][key] for g in gathered if g[part].get(key) is not None]
            if not values:
                merged[key] = None
            elif key in SAME_ON_EVERY_RANK:
                merged[key] = values[0]
            elif key.endswith("/max"):
                merged[key] = max(values)
            elif key.endswith("/min"):
                merged[key] = min(values)
            else:
                merged[key] = sum(values)
        out.append(merged)
    return out[0], out[1]
