"""``polyrl train --dry-run``: estimate the time of one RL step on this machine without training.

Two measurements on the configured model, engine and learner:

- rollout: generate 2 and then 16 new tokens (best of two tries each) for ``prompts_per_step`` prompts x
  ``group_size`` samples with stop tokens disabled; the difference gives the cost per decoded token, the rest
  the prefill. The rollout estimate is prefill + ``max_new_tokens`` x per-token cost: an upper bound, since
  replies that stop early cost less.
- update: one learner update (forward, backward, optimizer step, and the reference forward when KL is
  measured) on a dummy batch of the configured shape: every reply ``max_new_tokens`` long.
- peak memory: this process's peak resident set after both, with the run built as training builds it: the
  expected peak of a training step (held-out evaluation, with its own batch size, may add to it). Over a long
  run, freed memory kept for reuse adds to it, up to ``runtime.memory_budget_gb``: that is printed beside it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl.config import Config
from polyrl.rollout.render import ChatRenderer
from polyrl.train.step import build_run
from polyrl.types import Trajectory

ASSUMED_PROMPT_TOKENS = 64


@dataclass
class StepEstimate:
    samples: int
    prompt_tokens: int
    prompt_source: str
    max_new_tokens: int
    prefill_s: float
    per_token_s: float
    update_s: float
    peak_rss_bytes: int | None = None
    memory_budget_bytes: int | None = None

    @property
    def rollout_s(self) -> float:
        return self.prefill_s + self.max_new_tokens * self.per_token_s

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.update_s

    def describe(self, steps: int) -> str:
        return "\n".join([
            f"samples per step: {self.samples}, prompt ~{self.prompt_tokens} tokens ({self.prompt_source}), "
            f"up to {self.max_new_tokens} new tokens each",
            f"rollout: <= {self.rollout_s:.2f} s  (prefill {self.prefill_s:.2f} s + {self.max_new_tokens} x "
            f"{self.per_token_s * 1000:.1f} ms per decoded token; measured by generating 2 and 16 tokens, "
            "an upper bound since replies that stop early cost less)",
            f"update:  {self.update_s:.2f} s  (one learner update on a dummy batch of {self.samples} x "
            f"{self.prompt_tokens + self.max_new_tokens} tokens, timed)",
            f"step:   <= {self.step_s:.2f} s; {steps} steps <= {_duration(self.step_s * steps)} "
            "(held-out evaluation before/after not included)",
            *([f"peak memory: ~{self.peak_rss_bytes / 1e9:.2f} GB resident (this process, after the rollout and "
               "the update above; replies as long as allowed)"] if self.peak_rss_bytes else []),
            *([f"memory kept between steps: freed memory stays for reuse until {self.memory_budget_bytes / 1e9:.2f} "
               "GB resident, then goes back before the next update (runtime.memory_budget_gb); a long run peaks "
               "near that plus one step's rise"] if self.memory_budget_bytes else []),
        ])


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _prompt(run: Any) -> tuple[list[int], str]:
    """Token ids of the first training prompt, or a dummy prompt of an assumed length."""
    try:
        task = next(iter(run.tasks.values()))
        item = task.train_item(0)
        messages = task.messages(item) if hasattr(task, "messages") else task.make_env().reset(item)
        return ChatRenderer(run.tokenizer).prompt(messages)[1], "the first training prompt"
    except Exception:  # noqa: BLE001 - an estimate only needs a plausible prompt length
        return [run.engine.pad_id] * ASSUMED_PROMPT_TOKENS, f"assumed {ASSUMED_PROMPT_TOKENS} tokens"


def _time_generate(engine: Any, prompts: list[list[int]], n: int, tokens: int, tries: int = 2) -> float:
    # The best of a few tries: timing noise only ever adds time.
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        engine.generate(prompts, n, max_new_tokens=tokens, temperature=1.0, top_p=1.0, seed=0)
        best = min(best, time.perf_counter() - t0)
    return best


def estimate_step(config: Config) -> StepEstimate:
    """Build the run's components (model, engine, learner) and time one rollout and one update."""
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(config, Path(tmp))
    ro = config.rollout
    prompt, source = _prompt(run)
    prompts = [prompt] * ro.prompts_per_step
    engine = run.engine
    stop_ids = engine.stop_ids
    engine.stop_ids = set()  # every row decodes to the end: the cost of the longest replies
    try:
        _time_generate(engine, prompts, ro.group_size, 1, tries=1)  # warm-up: first-call allocations
        lo, hi = 2, 16
        t_lo = _time_generate(engine, prompts, ro.group_size, lo)
        t_hi = _time_generate(engine, prompts, ro.group_size, hi)
    finally:
        engine.stop_ids = stop_ids
    per_token = max(t_hi - t_lo, 0.0) / (hi - lo)
    prefill = max(t_lo - lo * per_token, 0.0)

    generator = torch.Generator().manual_seed(0)
    vocab = min(len(run.tokenizer), 32_000)
    trajectories = []
    for g in range(ro.prompts_per_step):
        for _ in range(ro.group_size):
            reply = torch.randint(100, vocab, (ro.max_new_tokens,), generator=generator).tolist()
            n = len(reply)
            trajectories.append(Trajectory(
                task="dry-run", item_id=g, group_id=g, input_ids=prompt + reply,
                loss_mask=[0] * len(prompt) + [1] * n, logprobs=[0.0] * len(prompt) + [-1.0] * n,
                versions=[-1] * len(prompt) + [0] * n, reward=float(torch.rand((), generator=generator)),
                advantage=float(torch.randn((), generator=generator)),
            ))
    t0 = time.perf_counter()
    run.learner.update(trajectories)
    update = time.perf_counter() - t0
    return StepEstimate(
        samples=ro.prompts_per_step * ro.group_size, prompt_tokens=len(prompt), prompt_source=source,
        max_new_tokens=ro.max_new_tokens, prefill_s=prefill, per_token_s=per_token, update_s=update,
        peak_rss_bytes=_peak_rss_bytes(), memory_budget_bytes=run.memory_budget,
    )


def _peak_rss_bytes() -> int | None:
    """This process's peak resident set (Linux reports kilobytes, macOS bytes); None where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
