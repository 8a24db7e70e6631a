"""A batching queue in front of the engine: the requests of concurrent episodes go into one ``generate`` call.

Requests wait in the queue while the engine is busy; when it is free, everything queued (with the same sampling
settings) goes in one batch. Before a batch starts, the queue stays open while requests keep arriving (each
within ``window_s`` of the last, for at most ``max_wait_s``). In an agent rollout, where ``expected`` counts the
live episodes, it stays open until all of them are waiting, for at most half the last batch's time. Each
request's own token limit and stop strings end its rows through the engine's ``stop`` hook, so one long request
does not lengthen the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from polyrl.endpoint.chat import Sample


@dataclass
class Job:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stops: list[str]
    future: asyncio.Future
    owner: str | None = None
    """The episode that asked; its queued jobs are dropped when it is closed."""
    queued_at: float = field(default_factory=time.monotonic)


class Batcher:
    """Runs in the server's event loop; the engine runs in one worker thread, one batch at a time."""

    def __init__(self, engine: Any, window_s: float = 0.05, max_wait_s: float = 0.25, max_rows: int = 256) -> None:
        self.engine = engine
        self.window_s, self.max_wait_s, self.max_rows = window_s, max_wait_s, max_rows
        self.seed = 0
        self.expected: Callable[[], int] | None = None
        """How many callers share the engine now (an agent rollout's live episodes); None when unknown."""
        self.batches = 0
        self.batch_rows: list[int] = []
        self.last_batch_s = 0.0
        """How long the last ``generate`` call took."""
        self._queue: list[Job] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._busy = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="endpoint-engine")

    async def submit(self, job: Job) -> list[Sample]:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._queue.append(job)
        self._wake.set()
        return await job.future

    def drop(self, owner: str) -> None:
        """Forget the queued jobs of ``owner`` (a closed episode); a batch already running finishes."""
        for job in [j for j in self._queue if j.owner == owner]:
            self._queue.remove(job)
            if not job.future.done():
                job.future.cancel()

    @property
    def idle(self) -> bool:
        return not self._busy and not self._queue

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._gather()
                batch = self._take()
                self._busy = True
                try:
                    results = await asyncio.get_running_loop().run_in_executor(self._worker, self._generate, batch)
                except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the server
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(exc)
                else:
                    for job, samples in zip(batch, results, strict=True):
                        if not job.future.done():
                            job.future.set_result(samples)
                finally:
                    self._busy = False

    async def _gather(self) -> None:
        """Wait for more requests while they keep coming (each within ``window_s`` of the last, for at most
        ``max_wait_s``) and not every caller is waiting yet."""
        # With callers known (an agent rollout), waiting up to half a batch's time for stragglers is cheaper than
        # the extra batch they would otherwise need (what a loaded machine's slow thread starts cause).
        longest = max(self.max_wait_s, 0.5 * self.last_batch_s) if self.expected is not None else self.max_wait_s
        while self.expected is None or len(self._queue) < self.expected():
            window = self.window_s if self.expected is None else longest
            deadline = min(self._queue[0].queued_at + longest, self._queue[-1].queued_at + window)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(0.002, deadline - time.monotonic()))

    def _take(self) -> list[Job]:
        key = (self._queue[0].temperature, self._queue[0].top_p)
        batch, rows = [], 0
        for job in list(self._queue):
            if (job.temperature, job.top_p) == key and (not batch or rows + job.n <= self.max_rows):
                batch.append(job)
                rows += job.n
                self._queue.remove(job)
        return batch

    def _generate(self, batch: list[Job]) -> list[list[Sample]]:
        rows = [job for job in batch for _ in range(job.n)]
        prompts = [tuple(job.prompt_ids) for job in rows]
        counts = Counter(prompts)
        # The first turn of a group: every episode sends the same prompt; prefill it once for all of them.
        share = len(counts) < len(prompts) and len(set(counts.values())) == 1
        if share:
            per = next(iter(counts.values()))
            unique = list(dict.fromkeys(prompts))
            order = [r for u in unique for r, p in enumerate(prompts) if p == u]  # output row -> rows index
            inputs, n = [list(u) for u in unique], per
        else:
            order, inputs, n = list(range(len(rows))), [list(p) for p in prompts], 1
        limits = [rows[order[o]].max_tokens for o in range(len(order))]
        stops = [rows[order[o]].stops for o in range(len(order))]
        longest = max(limits)
        hook, cut = self._stop_hook(limits, longest, stops)
        self.batches += 1
        self.batch_rows.append(len(rows))
        started = time.perf_counter()
        groups = self.engine.generate(inputs, n, longest, rows[0].temperature, rows[0].top_p,
                                      self.seed + self.batches, **({"stop": hook} if hook else {}))
        self.last_batch_s = time.perf_counter() - started
        flat = [c for group in groups for c in group]
        samples: list[Sample | None] = [None] * len(rows)
        for o, completion in enumerate(flat):
            samples[order[o]] = self._sample(completion, o in cut, stops[o])
        out, i = [], 0
        for job in batch:
            out.append(samples[i : i + job.n])
            i += job.n
        return out

    def _stop_hook(self, limits: list[int], longest: int, stops: list[list[str]]):
        """The engine's ``stop`` hook when rows differ in limit or have stop strings; also which rows it cut at
        a stop string."""
        if all(limit == longest for limit in limits) and not any(stops):
            return None, set()
        tok = self.engine.tokenizer
        made: dict[int, list[int]] = {}

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        cut: set[int] = set()

        def hook(live, tokens, logprobs, entropies) -> list[bool]:
            flags = []
            for row, token in zip(live, tokens, strict=True):
                ids = made.setdefault(row, [])
                ids.append(token)
                hit = bool(stops[row]) and any(s in decode(ids) for s in stops[row])
                if hit:
                    cut.add(row)
                flags.append(hit or len(ids) >= limits[row])
            return flags

        return hook, cut

    def _sample(self, completion: Any, cut_at_stop: bool, stops: list[str]) -> Sample:
        tok = self.engine.tokenizer
        ids = completion.token_ids
        eos = completion.finished and bool(ids) and ids[-1] in self.engine.stop_ids
        raw = tok.decode(ids[:-1] if eos else ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        content = raw
        if cut_at_stop:
            content = raw[: min(raw.find(s) for s in stops if s in raw)]
        return Sample(list(ids), list(completion.logprobs), raw, eos, cut_at_stop, content)
