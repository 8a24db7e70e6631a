"""What a run's processes ask of the machine or the Ray cluster, checked before anything is started.

Ray waits, without a word, for resources that never come: an actor asking for more CPUs or GPUs than the
cluster has is never placed. So the learner rank actors and rollout workers a config asks for are counted
against the cluster before anything is placed (``capacity_problem``); for a local Ray, against this machine
before Ray is even started (``local_placement_problem``, run by ``polyrl train`` right after the config loads).
Only what certainly cannot be placed is refused: more processes than cores is legal (slower, not stuck), and
so is a CPU count a user gives Ray above the machine's.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from polyrl.config import engines_of
from polyrl.waits import WaitTimeoutError

CONNECT_TIMEOUT_S = 10.0
"""How long ``runtime.ray_address`` may take to accept a connection before the run says so (ray.init would
retry for minutes)."""


class PlacementError(RuntimeError):
    """The machine or the Ray cluster cannot hold what the config asks for."""


def capacity_problem(cluster: dict[str, float], ranks: int, workers: int, gpu: bool) -> str | None:
    """Why the cluster cannot hold ``ranks`` learner rank actors and ``workers`` rollout workers (one CPU each at
    least; a GPU each on cuda), or None. Checked before anything is placed: Ray would otherwise wait forever."""
    need = {"CPU": ranks + workers, **({"GPU": ranks + workers} if gpu else {})}
    for resource, count in need.items():
        have = int(cluster.get(resource, 0))
        if count > have:
            parts = ([f"{ranks} learner ranks"] if ranks else []) + ([f"{workers} rollout workers"] if workers else [])
            return (f"runtime: {' and '.join(parts)} need {count} {resource}s (one each at least), the Ray cluster "
                    f"has {have}: lower learner.world_size or runtime.num_workers, or add nodes")
    return None


def ray_actors(config: Any) -> tuple[int, int]:
    """(learner rank actors, rollout worker actors) a ``runtime.kind: ray`` run places; the driver is the one
    learner at world size 1 and needs no actor."""
    world = config.learner.world_size
    workers = config.runtime.num_workers if engines_of(config) == "disaggregated" else 0
    return (world if world > 1 else 0), workers


def local_placement_problem(config: Any, cpus: int | None = None, gpus: int | None = None) -> str | None:
    """Why a local Ray (``runtime.ray_address`` unset) on this machine cannot place the run's actors, or None.
    ``cpus`` and ``gpus`` default to what this machine has; Ray never counts more CPUs than ``os.cpu_count()``
    (it may count fewer under a cgroup quota: the check after Ray starts catches that)."""
    rt = config.runtime
    if rt.kind != "ray" or rt.ray_address:
        return None
    gpu = config.train.device == "cuda"
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if gpu else 0
    cluster = {"CPU": float(rt.ray_num_cpus or cpus or os.cpu_count() or 1), "GPU": float(gpus)}
    problem = capacity_problem(cluster, *ray_actors(config), gpu)
    return problem.replace("the Ray cluster has", "a local Ray on this machine has") if problem else None


def check_ray_address(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``runtime.ray_address`` (host:port, or ray://host:port) accepts a connection within ``timeout_s``;
    a one-line error otherwise. ``auto`` and unset are left to Ray."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port: Ray reads it its own way
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except TimeoutError:
        raise WaitTimeoutError(f"the Ray cluster at {address} to accept a connection", timeout_s,
                               "runtime.ray_address", "is the head node up and reachable?") from None
    except OSError as exc:
        raise PlacementError(f"runtime.ray_address: nothing answers at {address} ({exc.strerror or exc}); "
                             "start the head node (ray start --head) or fix the address") from None
