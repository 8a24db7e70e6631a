"""The Ray runtime with disaggregated engines: rollout workers as Ray actors (``runtime/workers.py``).

Learner rank 0 (the driver process at ``learner.world_size`` 1, else a rank actor) holds the worker pool. A
producer thread there draws each step's tasks (``produce_batch``) and splits the step's groups over
``runtime.num_workers`` actors; it starts batch ``s`` once the newest published weights have version
>= s - 1 - eta, so rollouts overlap the learner's update when eta > 0. Rank 0 hands each batch to the other
learner ranks; every rank takes its share of the update, then the weights go to the workers (through the
object store or a collective group, ``runtime.weight_sync``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from polyrl.parallel.group import broadcast_object
from polyrl.parallel.sync_group import SyncGroup
from polyrl.parallel.weight_sync import WeightSender
from polyrl.placement import PlacementError, check_ray_address
from polyrl.runtime.staleness import check_staleness, staleness_metrics
from polyrl.runtime.stepper import producer_state, snapshot
from polyrl.runtime.workers import WorkerPool
from polyrl.train.step import learn_batch, produce_batch, step_metrics
from polyrl.types import Trajectory
from polyrl.waits import WaitTimeoutError

# Ray puts its sockets under the temp dir (session_<timestamp>_<pid>/sockets/plasma_store, about 65 characters),
# and a Unix socket path may not exceed 107 bytes: a deep run directory would make ray.init fail.
_MAX_RAY_TEMP_LEN = 40


def _ray_temp_dir(run_dir: Path) -> str:
    """RUN_DIR/ray when its socket paths fit, else a short fresh directory under the system temp dir."""
    inside = str((run_dir / "ray").resolve())
    return inside if len(inside) <= _MAX_RAY_TEMP_LEN else tempfile.mkdtemp(prefix="polyrl-ray-")

def start_ray(rt: Any, run_dir: Path, log_to_driver: bool = False) -> bool:
    """Connect to ``runtime.ray_address``'s cluster, or start a local Ray; False when one was already running."""
    import ray

    if ray.is_initialized():
        return False
    check_ray_address(rt.ray_address)  # ray.init retries an address that does not answer for minutes
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=rt.ray_address, num_cpus=None if rt.ray_address else rt.ray_num_cpus,
             include_dashboard=False, log_to_driver=log_to_driver,
             _temp_dir=None if rt.ray_address else _ray_temp_dir(run_dir))
    return True


class RayStepper:
    """The learner's side of the Ray runtime, on every learner rank; rank 0 holds the workers."""

    def __init__(self, run: Any, start: int) -> None:
        try:
            import ray
        except ImportError:
            raise PlacementError("runtime.kind ray: ray is not installed; pip install 'polyrl[ray]'") from None
        self.ray, self.run, rt = ray, run, run.config.runtime
        self.ranks = run.plan.ranks
        self.main = self.ranks.is_main
        self.eta = rt.eta
        self.collective = run.plan.weight_sync == "collective"
        self._started_ray = start_ray(rt, run.run_dir) if self.main else False
        self.pool = WorkerPool(ray, run, self.collective) if self.main else None
        self.sender = None
        if self.collective:  # learner ranks > 0 only gather; rank 0's group is formed with the workers
            placeholder = SyncGroup(None, -1, 1 + rt.num_workers, next(run.model.parameters()).device, None)
            self.sender = WeightSender(run.model, placeholder, bucket_mb=rt.sync_bucket_mb)
        self.cond = threading.Condition()
        self.state = producer_state(run)  # after the last trained batch: the one a checkpoint keeps
        self.version, self.weights = start, None
        self.sync_metrics = self._publish(start)  # a resumed run's weights; at step 0 the workers build the same
        self.out: queue.Queue = queue.Queue()
        self.stop = False
        self.thread = None
        if self.main:
            # The producer draws from its own sampler (its replay buffers and curriculum are only its own: the
            # learner's side reads the state shipped with each batch).
            self.producer_run = dataclasses.replace(run, sampler=copy.deepcopy(run.sampler))
            self.thread = threading.Thread(target=self._produce, args=(start,), daemon=True)
            self.thread.start()
        self._last = time.perf_counter()

    def _produce(self, start: int) -> None:
        try:
            for step in range(start + 1, self.run.config.train.steps + 1):
                with self.cond:
                    self.cond.wait_for(lambda s=step: self.stop or self.version >= s - 1 - self.eta)
                    if self.stop:
                        return
                    version, weights = self.version, self.weights
                fn = lambda reqs, seed, v, first_id, s=step, w=weights: self.pool.scatter(s, reqs, seed, v, first_id, w)  # noqa: E731
                batch = produce_batch(self.producer_run, step, version, fn)
                self.out.put(("batch", batch, producer_state(self.producer_run)))
        except BaseException as exc:
            ends_run = exc if isinstance(exc, WaitTimeoutError) else None  # already one line for the user
            self.out.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), ends_run))

    def _publish(self, version: int) -> dict[str, float]:
        """Make ``version`` (the weights now) the workers' next: every rank takes part in a collective sync."""
        t0 = time.perf_counter()
        if self.collective:
            metrics = self.pool.sync(self.sender, version) if self.main else self.sender.send(version)
        elif self.main:
            self.weights = self.ray.put(snapshot(self.run.model))  # once into the object store, read by every worker
            metrics = {}
        if self.main:
            with self.cond:
                self.version = version
                self.cond.notify_all()
            metrics["sync/engines_time_s"] = time.perf_counter() - t0
        return metrics

    def _next_batch(self) -> tuple[Any, dict]:
        while True:
            try:
                msg = self.out.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("runtime.kind ray: the producer thread ended without a batch") from None
        if msg[0] == "error":
            if msg[3] is not None:
                raise msg[3]
            raise RuntimeError(f"runtime.kind ray: producing a batch failed: {msg[1]}\n{msg[2]}")
        return msg[1], msg[2]

    def step(self, step: int) -> tuple[dict[str, Any], list[Trajectory]]:
        batch, state = self._next_batch() if self.main else (None, None)
        if self.ranks.distributed:  # every rank trains on rank 0's batch
            batch, state = broadcast_object(self.ranks, (batch, state))
        if batch.step != step:
            raise RuntimeError(f"runtime.kind ray: expected the batch of step {step}, got step {batch.step}")
        check_staleness(batch.kept, step - 1, self.eta, "runtime.kind ray")
        lock = self.pool.weights_lock if self.main else _NO_LOCK
        with lock:  # a worker replaced meanwhile must not copy half-updated weights
            update, t_update = learn_batch(self.run, batch)
            if step < self.run.config.train.steps:
                update |= self._publish(step)
        self.state = state
        self.run.sampler.load_state_dict(state["sampler"])  # the realised task ratio the loop logs
        now = time.perf_counter()
        metrics = step_metrics(batch, update, t_update, now - self._last)
        self._last = now
        metrics.update(staleness_metrics(batch.kept, step - 1))
        if self.main:
            metrics["ray/worker_restarts"] = float(self.pool.restarts)
        return metrics, batch.kept

    def producer_state(self) -> dict[str, Any]:
        return self.state

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)
        if self.pool is not None:
            self.pool.close()
        if self._started_ray:
            self.ray.shutdown()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
