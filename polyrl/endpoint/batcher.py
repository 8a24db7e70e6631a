"""A batching queue in front of the engine: the requests of concurrent episodes go into one ``generate`` call.

Requests wait in the queue while the engine is busy; when it is free, everything queued (with the same sampling
settings) goes in one batch. Before a batch starts, the queue stays open while requests keep arriving (each
within ``window_s`` of the last, for at most ``max_wait_s``). In an agent rollout, where ``expected`` counts the
live episodes, it stays open until all of them are waiting, for at most half the last batch's time.

The engine's per-step ``stop`` hook does four things for each live row: it hands a streaming request its tokens
as they are sampled, ends the row at its own request's token limit or stop string (so one long request does not
lengthen the others), and ends the rows of a request whose caller has gone (a client that disconnected, a
closed episode) at the next step. A request with its own ``seed`` runs in a batch of its own, its generator
seeded with it, so its samples do not depend on what else was queued.
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


@dataclass(eq=False)  # a job is itself: queue removal by identity
class Job:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stops: list[str]
    future: asyncio.Future
    owner: str | None = None
    """The episode that asked; its jobs are dropped when it is closed."""
    seed: int | None = None
    """The request's own seed: the job runs alone, sampled with it (None: the batcher's seed)."""
    top_logprobs: int = 0
    tokens: asyncio.Queue | None = None
    """Given: receives (choice, token id, log-prob) as each token is sampled, then None when the job is done."""
    queued_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    """Its caller has gone: its rows end at the next decoding step (read from the engine's thread)."""

    def finish(self) -> None:
        if self.tokens is not None:
            self.tokens.put_nowait(None)


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
        self._running: list[Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="endpoint-engine")

    async def submit(self, job: Job) -> list[Sample]:
        """The job's samples; cancelling the caller (a client gone) cancels the job."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._run())
        self._queue.append(job)
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def cancel(self, job: Job) -> None:
        """Take ``job`` out of the queue, or end its rows at the running batch's next step."""
        job.cancelled = True
        if job in self._queue:
            self._queue.remove(job)
        if not job.future.done():
            job.future.cancel()
        job.finish()  # a stream waiting on its tokens ends

    def drop(self, owner: str) -> None:
        """Cancel the jobs of ``owner`` (a closed episode), queued or running."""
        for job in [j for j in self._queue + self._running if j.owner == owner]:
            self.cancel(job)

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
                if not batch:
                    continue
                self._busy, self._running = True, batch
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
                    for job in batch:
                        job.finish()
                    self._busy, self._running = False, []

    async def _gather(self) -> None:
        """Wait for more requests while they keep coming (each within ``window_s`` of the last, for at most
        ``max_wait_s``) and not every caller is waiting yet."""
        # With callers known (an agent rollout), waiting up to half a batch's time for stragglers is cheaper than
        # the extra batch they would otherwise need (what a loaded machine's slow thread starts cause).
        longest = max(self.max_wait_s, 0.5 * self.last_batch_s) if self.expected is not None else self.max_wait_s
        while self._queue and (self.expected is None or len(self._queue) < self.expected()):
            window = self.window_s if self.expected is None else longest
            deadline = min(self._queue[0].queued_at + longest, self._queue[-1].queued_at + window)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(0.002, deadline - time.monotonic()))

    def _take(self) -> list[Job]:
        for job in [j for j in self._queue if j.future.done()]:  # cancelled while queued
            self._queue.remove(job)
        if not self._queue:
            return []
        first = self._queue[0]
        if first.seed is not None:  # alone: its samples must not depend on what else is queued
            return [self._queue.pop(0)]
        key = (first.temperature, first.top_p)
        batch, rows = [], 0
        for job in list(self._queue):
            fits = not batch or rows + job.n <= self.max_rows
            if job.seed is None and (job.temperature, job.top_p) == key and fits:
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
        choice = [k for job in batch for k in range(job.n)]  # rows index -> its choice within its job
        who = [(rows[order[o]], choice[order[o]]) for o in range(len(order))]  # output row -> (job, choice)
        hook, cut = self._stop_hook(who)
        seed = batch[0].seed if batch[0].seed is not None else self.seed + self.batches + 1
        self.batches += 1
        self.batch_rows.append(len(rows))
        started = time.perf_counter()
        top = max(job.top_logprobs for job in batch)  # asked of the engine only when a request wants them
        groups = self.engine.generate(inputs, n, max(job.max_tokens for job in batch), rows[0].temperature,
                                      rows[0].top_p, seed, stop=hook, **({"top_logprobs": top} if top else {}))
        self.last_batch_s = time.perf_counter() - started
        flat = [c for group in groups for c in group]
        samples: list[Sample | None] = [None] * len(rows)
        for o, completion in enumerate(flat):
            samples[order[o]] = self._sample(completion, o in cut, who[o][0])
        out, i = [], 0
        for job in batch:
            out.append(samples[i : i + job.n])
            i += job.n
        return out

    def _stop_hook(self, who: list[tuple[Job, int]]):
        """The engine's ``stop`` hook for output rows played by ``who`` (job, choice), and the set of rows it
        cut at a stop string."""
        tok = self.engine.tokenizer
        made: dict[int, list[int]] = {}
        cut: set[int] = set()
        post = self._loop.call_soon_threadsafe

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        def hook(live, tokens, logprobs, entropies) -> list[bool]:
            flags = []
            for row, token, logprob in zip(live, tokens, logprobs, strict=True):
                job, k = who[row]
                ids = made.setdefault(row, [])
                ids.append(token)
                if job.tokens is not None:
                    post(job.tokens.put_nowait, (k, token, logprob))
                hit = bool(job.stops) and any(s in decode(ids) for s in job.stops)
                if hit:
                    cut.add(row)
                flags.append(hit or job.cancelled or len(ids) >= job.max_tokens)
            return flags

        hook.reads_entropy = False  # type: ignore[attr-defined]  # runs on every batch: spare the engine the softmax
        return hook, cut

    def _sample(self, completion: Any, cut_at_stop: bool, job: Job) -> Sample:
        tok = self.engine.tokenizer
        ids = completion.token_ids
        eos = completion.finished and bool(ids) and ids[-1] in self.engine.stop_ids
        raw = tok.decode(ids[:-1] if eos else ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        content = raw
        if cut_at_stop:
            content = raw[: min(raw.find(s) for s in job.stops if s in raw)]
        tops = [step[: job.top_logprobs] for step in completion.top_logprobs] if job.top_logprobs else None
        return Sample(list(ids), list(completion.logprobs), raw, eos, cut_at_stop, content, tops)
