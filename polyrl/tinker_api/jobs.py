"""Where the server's computations run: one worker thread, one computation at a time (torch already spreads
each over the cores), in the order they became ready.

Tinker clients number a training model's requests (``seq_id``) and may send them out of order (the chunks of
one ``forward_backward`` go concurrently, the first last); ``Sequencer`` holds each until those before it have
been queued. Sample requests waiting together for the same sampler and settings are decoded in one engine call
(``Worker``), as a batch of prompts is on polyrl's own rollouts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from polyrl.tinker_api.sampler import MAX_BATCH_ROWS, SampleJob, Sampler
from polyrl.tinker_api.wire import WireError

log = logging.getLogger("polyrl.tinker")
COALESCE_S = 0.05
"""How long a sample request waits for others to join its engine call: the cookbook's rollouts send a group's
samples as separate requests, a few milliseconds apart."""


@dataclass
class Call:
    fn: Callable[[], Any]
    future: Future
    name: str = "call"


@dataclass
class Sample:
    sampler_id: str
    job: SampleJob
    resolve: Callable[[str], Sampler]
    """The sampler's snapshot, loaded or built if need be (in the worker)."""
    arrived: float = field(default_factory=time.monotonic)


class Worker:
    def __init__(self, seed: int = 0) -> None:
        self._queue: deque[Call | Sample] = deque()
        self._ready = threading.Condition()
        self._rng = random.Random(seed)  # seeds of requests that give none: a server's runs repeat from its seed
        self._thread = threading.Thread(target=self._loop, name="polyrl-tinker-worker", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any], future: Future | None = None, name: str = "call") -> Future:
        future = future or Future()
        self._put(Call(fn, future, name))
        return future

    def sample(self, sampler_id: str, job: SampleJob, resolve: Callable[[str], Sampler]) -> Future:
        self._put(Sample(sampler_id, job, resolve))
        return job.future

    def _put(self, task: Call | Sample) -> None:
        with self._ready:
            self._queue.append(task)
            self._ready.notify()

    def _take(self) -> list[Call | Sample]:
        """The next task, and with a sample request every queued one that can be decoded with it."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            first = self._queue.popleft()
            if isinstance(first, Call):
                return [first]
            while (wait := first.arrived + COALESCE_S - time.monotonic()) > 0:
                self._ready.wait(wait)
            batch: list[Call | Sample] = [first]
            rows, key = first.job.n, (first.sampler_id, first.job.batch_key())
            for task in list(self._queue):
                if (isinstance(task, Sample) and (task.sampler_id, task.job.batch_key()) == key
                        and rows + task.job.n <= MAX_BATCH_ROWS):
                    self._queue.remove(task)
                    batch.append(task)
                    rows += task.job.n
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            began = time.perf_counter()
            if isinstance(batch[0], Call):
                _settle(batch[0].future, batch[0].fn)
                log.info("%s: %.2f s", batch[0].name, time.perf_counter() - began)
            else:
                self._sample([t for t in batch if isinstance(t, Sample)])
                log.info("sample: %d requests, %d rows: %.2f s", len(batch),
                         sum(t.job.n for t in batch if isinstance(t, Sample)), time.perf_counter() - began)

    def _sample(self, tasks: list[Sample]) -> None:
        try:
            sampler = tasks[0].resolve(tasks[0].sampler_id)
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets the reason
            for t in tasks:
                t.job.future.set_exception(exc)
            return
        jobs = []
        for t in tasks:
            try:
                sampler.check(t.job)
                jobs.append(t.job)
            except WireError as exc:
                t.job.future.set_exception(exc)
        if not jobs:
            return
        seed = jobs[0].seed if jobs[0].seed is not None else self._rng.randrange(2**31)
        try:
            results = sampler.run(jobs, seed)
        except Exception as exc:  # noqa: BLE001
            log.exception("sampling failed")
            for job in jobs:
                job.future.set_exception(exc)
            return
        for job, result in zip(jobs, results, strict=True):
            job.future.set_result(result)


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - the caller reads it from the future
        if not isinstance(exc, WireError):
            log.exception("request failed")
        future.set_exception(exc)


class Sequencer:
    """Releases a training model's requests to the worker in ``seq_id`` order (1, 2, ...)."""

    def __init__(self, worker: Worker, model_id: str) -> None:
        self.worker, self.model_id = worker, model_id
        self.next = 1
        self.waiting: dict[int, Call | None] = {}
        self._lock = threading.Lock()

    def submit(self, seq_id: int | None, fn: Callable[[], Any], name: str = "call") -> Future:
        future: Future = Future()
        if seq_id is None:  # an unnumbered request runs in arrival order
            return self.worker.call(fn, future, name)
        self._place(seq_id, Call(fn, future, name), future)
        return future

    def skip(self, seq_id: int) -> None:
        """A numbered request that was refused before it could be queued (an unimplemented call, a body that
        does not parse): its turn passes, so those after it are not held up."""
        self._place(seq_id, None, None)

    def _place(self, seq_id: int, call: Call | None, future: Future | None) -> None:
        with self._lock:
            if seq_id < self.next or seq_id in self.waiting:
                if future is not None:
                    future.set_exception(WireError(f"model {self.model_id}: request seq_id {seq_id} was "
                                                   "already received"))
                return
            self.waiting[seq_id] = call
            while self.next in self.waiting:
                ready = self.waiting.pop(self.next)
                if ready is not None:
                    self.worker.call(ready.fn, ready.future, ready.name)
                self.next += 1
