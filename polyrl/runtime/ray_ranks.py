"""Learner ranks as Ray actors: ``runtime.kind: ray`` with ``learner.world_size`` > 1.

The driver reserves one bundle per rank in a placement group (a GPU each on cuda, CPUs otherwise), so Ray
places the ranks on any nodes of the cluster; each rank is an actor that joins one torch.distributed group
(rank 0's node and a free port there as the rendezvous) and runs the same training loop as ranks started on
one machine: it rolls out its share of every step's groups on its own engine (colocated), or rank 0 sends
them to the rollout workers (``runtime.engines: disaggregated``, ``runtime/workers.py``), and trains its
shard. All ranks must see one run directory (a shared filesystem on a cluster).

A rank lost with its process or its node ends every rank at once (the others would otherwise wait in a
collective until its timeout); the driver then starts them all again from the newest checkpoint, up to
``learner.max_restarts`` times, and after that stops with one line naming the rank.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.models.device import wants_gpu
from polyrl.parallel.group import RankFailedError, collective_timeout
from polyrl.parallel.launch import free_port
from polyrl.placement import PlacementError, capacity_problem, ray_actors
from polyrl.runtime.ray_ import start_ray
from polyrl.waits import WaitTimeoutError, ray_get

PLACEMENT_TIMEOUT_S = 120.0
"""How long the driver waits for the cluster to offer every rank's bundle before it says so and stops."""


class LearnerRank:
    """A Ray actor holding one learner rank's process."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, rank: int, world_size: int, master: tuple[str, int], threads: int, entry: Callable,
            args: tuple) -> None:
        import torch

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",  # Ray sets the GPU seen
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        torch.set_num_threads(threads)
        try:
            entry(*args)
        except RuntimeError as exc:  # gloo's own message names neither the wait nor the setting
            if timeout := collective_timeout(exc, rank):
                raise timeout from None
            raise


def train_on_ray_ranks(config: Any, run_dir: Path, entry: Callable[[Any, Path, bool], None], resume: bool) -> None:
    """Run ``entry(config, run_dir, resume)`` on ``learner.world_size`` rank actors; restart them all from
    the newest checkpoint when one is lost, up to ``learner.max_restarts`` times."""
    import ray

    started = start_ray(config.runtime, run_dir, log_to_driver=True)  # rank 0 reports the run as it goes
    try:
        for attempt in range(config.learner.max_restarts + 1):
            lost = _attempt(ray, config, run_dir, entry, resume or attempt > 0)
            if lost is None:
                return
            if attempt == config.learner.max_restarts:
                raise RankFailedError(f"{lost}; no restarts left (learner.max_restarts: "
                                      f"{config.learner.max_restarts})")
            print(f"{lost}; restarting all ranks from the newest checkpoint", flush=True)
    finally:
        if started:
            ray.shutdown()


def _attempt(ray: Any, config: Any, run_dir: Path, entry: Callable, resume: bool) -> str | None:
    """One start of every rank; None when they all finished, else what was lost. A rank that raised is
    not retried (it would raise again): its error ends the run."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world, gpu = config.learner.world_size, wants_gpu(config.train.device)
    # Disaggregated rollout workers (one CPU each, started by rank 0) need room beside the ranks' bundles.
    workers = ray_actors(config)[1]
    if problem := capacity_problem(ray.cluster_resources(), world, workers, gpu):
        raise PlacementError(problem)
    cpus = max(1, (int(ray.available_resources().get("CPU", world)) - workers) // world)
    bundle = {"CPU": cpus, **({"GPU": 1} if gpu else {})}
    group = placement_group([bundle] * world, strategy="PACK")
    try:
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise WaitTimeoutError(f"the Ray cluster to place {world} learner ranks of {bundle}", PLACEMENT_TIMEOUT_S,
                                   "learner.world_size", f"free: {ray.available_resources()} of "
                                   f"{ray.cluster_resources()}")
        actor = ray.remote(LearnerRank)
        ranks = [actor.options(num_cpus=cpus, num_gpus=1 if gpu else 0, max_restarts=0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
                 for i in range(world)]
        master = ray_get(ray, ranks[0].rendezvous.remote(), PLACEMENT_TIMEOUT_S, "learner rank 0's actor to start")
        pending = {r.run.remote(i, world, master, cpus, entry, (config, run_dir, resume)): i
                   for i, r in enumerate(ranks)}
        lost = None
        while pending and lost is None:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:  # its process or node is gone
                lost = f"learner rank {rank} was lost ({type(exc).__name__})"
            except ray.exceptions.RayTaskError as exc:
                raise RankFailedError(f"learner rank {rank}: {_last_line(exc)}") from None
        for r in ranks:  # a lost rank leaves the others waiting in a collective: end them now
            ray.kill(r)
        return lost
    finally:
        remove_placement_group(group)


def _last_line(exc: BaseException) -> str:
    """The rank's own one line: the last of Ray's report, without the exception's qualified class name."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return re.sub(r"^([\w.]+\.)?(RankFailedError|WaitTimeoutError): ", "", lines[-1].strip())
