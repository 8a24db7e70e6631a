"""The Ray runtime: rollout workers as Ray actors, weights broadcast through the Ray object store.

The driver process holds the learner. A producer thread draws each step's tasks (``produce_batch``) and
splits the step's groups over ``runtime.num_workers`` actors; it starts batch ``s`` once the newest published
weights have version >= s - 1 - eta, so rollouts overlap the learner's update when eta > 0. After every
update the driver puts the state dict in the object store once (``ray.put``) and each worker loads it by
reference before its next rollout.

A worker that dies (killed, out of memory, node lost) is replaced by a fresh actor that loads the current
weights and redoes exactly the shard that was lost, with the same seed and group ids: results are collected
once per shard, so nothing is lost or counted twice.
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

from polyrl.parallel.group import SHARD_SEED_STRIDE, contiguous_shards
from polyrl.runtime.async_ import _snapshot
from polyrl.runtime.common import check_staleness, staleness_metrics
from polyrl.train import faults
from polyrl.types import Trajectory

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
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=rt.ray_address, num_cpus=None if rt.ray_address else rt.ray_num_cpus,
             include_dashboard=False, log_to_driver=log_to_driver,
             _temp_dir=None if rt.ray_address else _ray_temp_dir(run_dir))
    return True


class RolloutWorker:
    """A Ray actor: its own copy of the run (model, engine, tasks), rolling out the shards it is sent."""

    def __init__(self, config: Any, run_dir: Any, index: int, incarnation: int) -> None:
        from polyrl.train.step import build_run, local_rollout

        self.run = build_run(config, run_dir)
        self.rollout_fn = local_rollout(self.run)
        self.name, self.version = f"worker{index}.{incarnation}", -1

    def set_weights(self, version: int, state: dict) -> int:
        self.run.model.load_state_dict(state)
        self.run.engine.sync()
        self.version = version
        return version

    def rollout(self, step: int, requests: list[tuple[str, int]], seed: int, version: int, first_id: int):
        faults.point(self.name, step)  # kill tests: POLYRL_TEST_KILL_AT="worker0.0:2"
        if version != self.version:
            raise RuntimeError(f"{self.name}: asked for policy version {version}, holds {self.version}")
        tasks = self.run.tasks
        reqs = [(tasks[name], index, tasks[name].train_item(index)) for name, index in requests]
        return self.rollout_fn(reqs, seed, version, first_id)


class RayStepper:
    """The learner's side of the Ray runtime (the driver process)."""

    def __init__(self, run: Any, start: int) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError("runtime.kind ray: ray is not installed; pip install 'polyrl[ray]'") from None
        self.ray, self.run, rt = ray, run, run.config.runtime
        self.eta, self.restarts = rt.eta, 0
        self._started_ray = start_ray(rt, run.run_dir)
        self._actor = ray.remote(num_cpus=1, max_restarts=0)(RolloutWorker)
        self.incarnations = [0] * rt.num_workers
        self.workers = [self._new_worker(k) for k in range(rt.num_workers)]
        self.worker_version = [-1] * rt.num_workers
        self.cond = threading.Condition()
        self.version, self.weights = start, ray.put(_snapshot(run.model))
        self.out: queue.Queue = queue.Queue()
        self.stop = False
        # The producer draws from its own sampler; the learner's copy takes each batch's state (checkpoints).
        self.producer_run = dataclasses.replace(run, sampler=copy.deepcopy(run.sampler))
        self.thread = threading.Thread(target=self._produce, args=(start,), daemon=True)
        self.thread.start()
        self._last = time.perf_counter()

    def _new_worker(self, k: int):
        return self._actor.remote(self.run.config, self.run.run_dir, k, self.incarnations[k])

    def _produce(self, start: int) -> None:
        from polyrl.train.step import produce_batch

        try:
            for step in range(start + 1, self.run.config.train.steps + 1):
                with self.cond:
                    self.cond.wait_for(lambda s=step: self.stop or self.version >= s - 1 - self.eta)
                    if self.stop:
                        return
                    version, weights = self.version, self.weights
                fn = lambda reqs, seed, v, first_id, s=step, w=weights: self._scatter(s, reqs, seed, v, first_id, w)  # noqa: E731
                batch = produce_batch(self.producer_run, step, version, fn)
                self.out.put(("batch", batch, self.producer_run.sampler.state_dict()))
        except BaseException as exc:
            self.out.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))

    def _submit(self, k: int, step: int, shard, seed: int, version: int, first_id: int, weights):
        if self.worker_version[k] != version:
            self.workers[k].set_weights.remote(version, weights)  # an actor runs its calls in order
            self.worker_version[k] = version
        return self.workers[k].rollout.remote(step, shard, seed, version, first_id)

    def _scatter(self, step, requests, seed, version, first_id, weights) -> list[Trajectory]:
        """Roll out the requests' groups on the workers; a dead worker's shard is redone on its replacement."""
        ray = self.ray
        plain = [(task.name, index) for task, index, _ in requests]
        shards = {k: (plain[lo:hi], seed + k * SHARD_SEED_STRIDE, first_id + lo)
                  for k, (lo, hi) in enumerate(contiguous_shards(len(plain), len(self.workers))) if hi > lo}
        pending = {k: self._submit(k, step, *shards[k][:2], version, shards[k][2], weights) for k in shards}
        results: dict[int, list[Trajectory]] = {}
        while pending:
            k, ref = next(iter(pending.items()))
            try:
                results[k] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.restarts += 1
                self.incarnations[k] += 1
                self.workers[k], self.worker_version[k] = self._new_worker(k), -1
                pending[k] = self._submit(k, step, *shards[k][:2], version, shards[k][2], weights)
                continue
            del pending[k]
        return [t for k in sorted(results) for t in results[k]]

    def step(self, step: int) -> tuple[dict[str, Any], list[Trajectory]]:
        from polyrl.train.step import learn_batch, step_metrics

        while True:
            try:
                msg = self.out.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("runtime.kind ray: the producer thread ended without a batch") from None
        if msg[0] == "error":
            raise RuntimeError(f"runtime.kind ray: producing a batch failed: {msg[1]}\n{msg[2]}")
        batch, sampler_state = msg[1], msg[2]
        if batch.step != step:
            raise RuntimeError(f"runtime.kind ray: expected the batch of step {step}, got step {batch.step}")
        check_staleness(batch.kept, step - 1, self.eta, "runtime.kind ray")
        update, t_update = learn_batch(self.run, batch)
        if step < self.run.config.train.steps:
            weights = self.ray.put(_snapshot(self.run.model))  # once into the object store, read by every worker
            with self.cond:
                self.version, self.weights = step, weights
                self.cond.notify_all()
        self.run.sampler.load_state_dict(sampler_state)
        now = time.perf_counter()
        metrics = step_metrics(batch, update, t_update, now - self._last)
        self._last = now
        metrics.update(staleness_metrics(batch.kept, step - 1))
        metrics["ray/worker_restarts"] = float(self.restarts)
        return metrics, batch.kept

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
        for w in self.workers:
            self.ray.kill(w)
        if self._started_ray:
            self.ray.shutdown()
