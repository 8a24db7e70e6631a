"""The async runtime: a rollout process produces scored batches while the learner updates.

Both processes build the same run from the config (same seed, same weights). The learner ships its weights
as a versioned state dict after every update (version v = after v updates); the rollout process loads the
newest it has received before each batch and, with partial rollouts, between chunks of generation. Batch
``s`` (trained at learner version s - 1) may start only once the rollout process holds version
>= s - 1 - eta, so every trained token obeys the staleness bound; with eta = 0 the rollout process always
waits for the latest update, which reproduces the local runtime exactly.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from polyrl.config import Config
from polyrl.parallel.launch import adopt_environ, fork_server
from polyrl.plan import resolve_plan
from polyrl.runtime.partial import PartialEngine
from polyrl.runtime.staleness import check_staleness, staleness_metrics
from polyrl.runtime.stepper import load_producer_state, producer_state, snapshot
from polyrl.train.step import build_run, learn_batch, local_rollout, produce_batch, step_metrics
from polyrl.types import Trajectory
from polyrl.waits import WaitTimeoutError

_POLL_S = 1.0


class _Stop(Exception):
    """The learner asked the rollout process to end."""


def _rollout_main(
    config: Config, run_dir: Path, start: int, start_state: dict, weights_q: Any, batch_q: Any, threads: int,
    environ: dict[str, str], learner_alive: Any,
) -> None:
    """The rollout process: produce batches start+1 .. train.steps in order, each from the newest weights
    allowed, and send each with the producer's state after it (the learner checkpoints that state)."""
    try:
        adopt_environ(environ)
        torch.set_num_threads(threads)
        rt = config.runtime
        run = build_run(config, run_dir, resolve_plan(config))  # its own plan: in no learners' group
        load_producer_state(run, start_state)
        version = -1

        def take(block: bool) -> int:
            """Load the newest weights waiting (waiting for one when ``block``); return the version held."""
            nonlocal version
            newest = None
            while True:
                waiting = block and newest is None
                try:
                    msg = weights_q.get(timeout=_POLL_S if waiting else 0.001)
                except queue.Empty:
                    # The learner never writes to this pipe: it reads as closed once the learner is gone (killed
                    # too), and this process ends instead of lingering.
                    if waiting and learner_alive.poll():
                        raise _Stop from None
                    if waiting:
                        continue
                    break
                if msg is None:
                    raise _Stop
                newest = msg
            if newest is not None:
                version, state = newest
                run.model.load_state_dict(state)
                run.engine.sync()
            return version

        rollout_fn = local_rollout(run)
        if rt.partial_rollouts:
            engine = run.engine
            run.engine = PartialEngine(engine, rt.chunk_tokens, lambda: take(False))
            rollout_fn = local_rollout(run)
            run.engine = engine
        for step in range(start + 1, config.train.steps + 1):
            take(False)
            while version < step - 1 - rt.eta:
                take(True)
            batch = produce_batch(run, step, version, rollout_fn)
            batch_q.put(("batch", batch, producer_state(run)))
    except _Stop:
        return
    except BaseException as exc:  # the learner re-raises it, one line plus the worker's traceback
        batch_q.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class AsyncStepper:
    """The learner's side: receive batch s, update, publish version s."""

    def __init__(self, run: Any, start: int) -> None:
        self.run, self.eta = run, run.config.runtime.eta
        ctx = fork_server(__name__)
        self.weights_q, self.batch_q = ctx.Queue(), ctx.Queue()
        learner_alive, self._alive = ctx.Pipe(duplex=False)  # the writing end stays open while this process lives
        threads = run.config.runtime.rollout_threads or torch.get_num_threads()
        self.proc = ctx.Process(
            target=_rollout_main,
            args=(run.config, run.run_dir, start, producer_state(run), self.weights_q, self.batch_q, threads,
                  dict(os.environ), learner_alive),
            daemon=True,
        )
        self.proc.start()
        learner_alive.close()
        self.weights_q.put((start, snapshot(run.model)))
        self.state = producer_state(run)  # after the last trained batch: the one a checkpoint keeps
        self._last = time.perf_counter()

    def _receive(self, step: int) -> tuple[Any, dict]:
        """Batch ``step`` from the rollout process; a process that dies or sends nothing for
        ``learner.timeout_s`` (it hangs) ends the run."""
        timeout = self.run.config.learner.timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.batch_q.get(timeout=min(_POLL_S, timeout))
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"runtime.kind async: the rollout process died (exit code "
                                       f"{self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    self.proc.kill()  # a hung process would not answer the stop message either
                    raise WaitTimeoutError(f"the rollout process's batch of step {step}", timeout,
                                           "learner.timeout_s", "the rollout process hangs") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"runtime.kind async: the rollout process failed: {msg[1]}\n{msg[2]}")
            return msg[1], msg[2]

    def step(self, step: int) -> tuple[dict[str, Any], list[Trajectory]]:
        batch, state = self._receive(step)
        if batch.step != step:
            raise RuntimeError(f"runtime.kind async: expected the batch of step {step}, got step {batch.step}")
        check_staleness(batch.kept, step - 1, self.eta, "runtime.kind async")
        update, t_update = learn_batch(self.run, batch)
        if step < self.run.config.train.steps:
            self.weights_q.put((step, snapshot(self.run.model)))
        self.state = state
        self.run.sampler.load_state_dict(state["sampler"])  # the realised task ratio the loop logs
        now = time.perf_counter()
        metrics = step_metrics(batch, update, t_update, now - self._last)
        self._last = now
        metrics.update(staleness_metrics(batch.kept, step - 1))
        return metrics, batch.kept

    def producer_state(self) -> dict[str, Any]:
        return self.state

    def close(self) -> None:
        if self.proc.is_alive():
            self.weights_q.put(None)
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._alive.close()
