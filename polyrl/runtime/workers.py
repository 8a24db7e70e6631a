"""Disaggregated rollout engines: Ray actors with their own copy of the run, fed each update's weights.

The pool lives with learner rank 0 (the driver at learner world size 1). ``scatter`` splits a step's groups
over the workers; a worker that dies (killed, out of memory, node lost) is replaced by a fresh actor that
redoes exactly the shard that was lost, with the same seed and group ids, so nothing is lost or counted twice.

Weights reach the workers one of two ways (``runtime.weight_sync``):

- object_store: after each update rank 0 puts one full state dict into Ray's object store; each worker loads
  it by reference before its next rollout.
- collective: rank 0 and the workers form a torch.distributed group (``parallel/weight_sync.py``). After each
  update every learner rank takes part in ``WeightSender.send`` (the shards gathered bucket by bucket, no full
  copy) while each worker runs ``WeightReceiver.receive``. A replacement worker loads rank 0's whole engine
  copy once through the object store, and the group is formed again before the next sync. A sync that fails
  (a worker lost during it) replaces every worker, because the others may be stuck mid-broadcast.

A worker labels its trajectories with the version it holds, never older than the version asked for.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from polyrl.checkpoint import faults
from polyrl.models.device import wants_gpu
from polyrl.parallel.group import SHARD_SEED_STRIDE, contiguous_shards
from polyrl.parallel.launch import free_port
from polyrl.parallel.sync_group import SyncGroup, join_sync_group
from polyrl.parallel.weight_sync import WeightReceiver, WeightSender
from polyrl.placement import PlacementError, capacity_problem
from polyrl.plan import resolve_plan
from polyrl.runtime.stepper import snapshot
from polyrl.train.step import build_run, local_rollout
from polyrl.types import Trajectory
from polyrl.waits import is_timeout, ray_get

START_TIMEOUT_S = 300.0
"""How long rank 0 waits for its rollout workers to be placed and built before it says so and stops."""


class RolloutWorker:
    """A Ray actor: its own copy of the run (model, engine, tasks), rolling out the shards it is sent."""

    def __init__(self, config: Any, run_dir: Any, index: int, incarnation: int) -> None:
        self.run = build_run(config, run_dir, resolve_plan(config))  # its own plan: in no learners' group
        self.rollout_fn = local_rollout(self.run)
        self.index, self.name, self.version = index, f"worker{index}.{incarnation}", -1
        self.receiver: WeightReceiver | None = None

    def ready(self) -> bool:
        """Answered once the actor is built (a failed start raises at the caller instead)."""
        return True

    def set_weights(self, version: int, state: dict) -> int:
        self.run.model.load_state_dict(state)
        self.run.engine.sync()
        self.version = version
        return version

    def join_sync(self, host: str, port: int, num_engines: int, backend: str, timeout_s: float) -> None:
        """Leave the previous sync group, if any, and join learner rank 0's at ``host:port``."""
        if self.receiver is not None:
            self.receiver.group.close()
        group = join_sync_group("engine", self.index, num_engines, host, port, backend, timeout_s)
        self.receiver = WeightReceiver(group, self.run.engine, model=self.run.model)

    def receive_weights(self) -> dict[str, float]:
        faults.point(f"{self.name}.sync", self.version + 1)  # kill tests: "worker0.0.sync:2", lost in a sync
        metrics = self.receiver.receive()
        self.version = int(metrics["sync/version"])
        return metrics

    def rollout(self, step: int, requests: list[tuple[str, int]], seed: int, version: int, first_id: int):
        faults.point(self.name, step)  # kill tests: POLYRL_TEST_KILL_AT="worker0.0:2"
        if self.version < version:
            raise RuntimeError(f"{self.name}: asked for policy version {version}, holds {self.version}")
        tasks = self.run.tasks
        reqs = [(tasks[name], index, tasks[name].train_item(index)) for name, index in requests]
        return self.rollout_fn(reqs, seed, self.version, first_id)


class WorkerPool:
    """``runtime.num_workers`` rollout workers, held by learner rank 0.

    ``weights_lock`` is held by the learner while it changes the weights (update and sync), so that a
    replacement worker never copies half-updated weights. ``lock`` guards the actors and the sync group.
    """

    def __init__(self, ray: Any, run: Any, collective: bool) -> None:
        self.ray, self.run, self.collective = ray, run, collective
        gpu = wants_gpu(run.config.train.device)
        if run.plan.world_size == 1 and (problem := capacity_problem(
                ray.cluster_resources(), 0, run.plan.rollout_workers, gpu)):
            raise PlacementError(problem)
        self._actor = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0)(RolloutWorker)
        self.incarnations = [0] * run.plan.rollout_workers
        self.workers = [self._new_worker(k) for k in range(len(self.incarnations))]
        self.worker_version = [-1] * len(self.workers)
        self.lock, self.weights_lock = threading.RLock(), threading.RLock()
        self.restarts, self.version, self.group_stale = 0, -1, collective
        self.group: SyncGroup | None = None
        self.wait_ready()  # a worker that cannot be placed ends the run here, not in the first rollout

    def wait_ready(self) -> None:
        """Every worker built; a worker Ray cannot place within START_TIMEOUT_S ends the run with one line."""
        refs = [w.ready.remote() for w in self.workers]
        what = f"{len(self.workers)} rollout workers (1 CPU each) to be placed and built"
        ray_get(self.ray, refs, START_TIMEOUT_S, what, "runtime.num_workers",
                lambda: f"free in the Ray cluster: {self.ray.available_resources()}")

    def _new_worker(self, k: int):
        return self._actor.remote(self.run.config, self.run.run_dir, k, self.incarnations[k])

    def _replace(self, ks: list[int]) -> None:
        """Fresh actors for workers ``ks``; under collective sync they load rank 0's engine copy at once."""
        with self.weights_lock, self.lock:
            state = self.ray.put(snapshot(self.run.engine_model)) if self.collective else None
            for k in ks:
                self.ray.kill(self.workers[k])
                self.restarts += 1
                self.incarnations[k] += 1
                self.workers[k], self.worker_version[k] = self._new_worker(k), -1
                if state is not None:
                    self.workers[k].set_weights.remote(self.version, state)
                    self.worker_version[k] = self.version
            self.group_stale = self.collective

    def _submit(self, k: int, step: int, shard, seed: int, version: int, first_id: int, weights):
        with self.lock:
            if not self.collective and self.worker_version[k] != version:
                self.workers[k].set_weights.remote(version, weights)  # an actor runs its calls in order
                self.worker_version[k] = version
            return self.workers[k].rollout.remote(step, shard, seed, version, first_id), self.incarnations[k]

    def scatter(self, step: int, requests, seed: int, version: int, first_id: int, weights=None) -> list[Trajectory]:
        """Roll out the requests' groups on the workers (``weights``: the object-store reference of ``version``);
        a dead worker's shard is redone on its replacement."""
        ray = self.ray
        plain = [(task.name, index) for task, index, _ in requests]
        shards = {k: (plain[lo:hi], seed + k * SHARD_SEED_STRIDE, first_id + lo)
                  for k, (lo, hi) in enumerate(contiguous_shards(len(plain), len(self.workers))) if hi > lo}
        pending = {k: self._submit(k, step, *shards[k][:2], version, shards[k][2], weights) for k in shards}
        results: dict[int, list[Trajectory]] = {}
        timeout = self.run.config.learner.timeout_s
        while pending:
            k, (ref, incarnation) = next(iter(pending.items()))
            try:
                results[k] = ray_get(ray, ref, timeout, f"rollout worker {k}'s share of step {step}",
                                     "learner.timeout_s", "the worker hangs")
            except ray.exceptions.RayActorError:
                if self.incarnations[k] == incarnation:  # not yet replaced by a failed sync
                    self._replace([k])
                pending[k] = self._submit(k, step, *shards[k][:2], version, shards[k][2], weights)
                continue
            del pending[k]
        return [t for k in sorted(results) for t in results[k]]

    def _form_group(self, sender: WeightSender) -> None:
        """A new sync group of rank 0 and every current worker (after a start or a replacement)."""
        if self.group is not None:
            self.group.close()
        cfg = self.run.config
        host, port = self.ray.util.get_node_ip_address(), free_port()
        backend = "nccl" if next(self.run.model.parameters()).device.type == "cuda" else "gloo"
        timeout = cfg.learner.timeout_s
        # Joining blocks until every worker joins: a worker that failed to start must raise here instead.
        self.wait_ready()
        joins = [w.join_sync.remote(host, port, len(self.workers), backend, timeout) for w in self.workers]
        self.group = join_sync_group("learner", 0, len(self.workers), host, port, backend, timeout)
        ray_get(self.ray, joins, timeout, "the rollout workers to join the weight-sync group", "learner.timeout_s")
        sender.group, self.group_stale = self.group, False

    def sync(self, sender: WeightSender, version: int) -> dict[str, float]:
        """Rank 0's side of a collective sync (the other learner ranks call ``sender.send`` alone)."""
        ray = self.ray
        with self.lock:
            if self.group_stale:
                self._form_group(sender)
            refs = [w.receive_weights.remote() for w in self.workers]
            try:
                metrics = sender.send(version)
                ray_get(ray, refs, self.run.config.learner.timeout_s, "the rollout workers to load the weights",
                        "learner.timeout_s")
            except Exception as exc:
                # Survivors may wait mid-broadcast for bytes that never come: every worker is replaced, and
                # loads the weights of ``version`` whole (the caller still holds weights_lock).
                why = (f"waited {self.run.config.learner.timeout_s:g} s (learner.timeout_s) for the rollout workers"
                       if is_timeout(exc) else f"{type(exc).__name__}: {exc}")
                print(f"weight sync of version {version} failed ({why}); replacing every rollout worker",
                      file=sys.stderr, flush=True)
                self.version = version
                self._replace(list(range(len(self.workers))))
                return {"sync/engines_failed": 1.0}
            self.worker_version = [version] * len(self.workers)
            self.version = version
        return {"sync/engines_failed": 0.0} | {f"sync/engines_{k.removeprefix('sync/')}": v
                                                for k, v in metrics.items()}

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        if self.group is not None:
            self.group.close()
