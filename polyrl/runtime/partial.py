"""Partial rollouts (PipelineRL, Piché et al. 2025; CoPRIS, 2025): generation that can be interrupted at a
weight update and continued with the new weights.

``PartialEngine`` wraps an engine and generates in chunks of ``chunk_tokens``; between chunks it calls
``refresh()``, which may load newer weights and returns the current policy version. A continued row is
re-prefilled (prompt plus its tokens so far) under the new weights, so its KV cache is never stale. Each
token keeps the log-prob and the version of the policy that actually sampled it (``VersionedCompletion``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from polyrl.engines.hf import Completion
from polyrl.engines.protocol import Engine

CHUNK_SEED_STRIDE = 7_919_993  # later chunks draw from seeds far from the first chunk's


@dataclass
class VersionedCompletion(Completion):
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (aligned with ``token_ids``)."""


class PartialEngine:
    """An engine whose completions may span several policy versions."""

    def __init__(self, engine: Engine, chunk_tokens: int, refresh: Callable[[], int]) -> None:
        self.engine, self.chunk, self.refresh = engine, chunk_tokens, refresh
        self.tokenizer, self.pad_id, self.stop_ids = engine.tokenizer, engine.pad_id, engine.stop_ids

    def sync(self) -> None:
        self.engine.sync()

    def release_memory(self, until_used: bool = False) -> None:
        """Nothing: chunks keep being generated while the learner updates, so the engine's weights stay."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        **unsupported,
    ) -> list[list[VersionedCompletion]]:
        """As ``Engine.generate``; result[i][j] is the j-th sample of prompt i, tokens tagged by version."""
        if unsupported:
            raise ValueError(f"partial rollouts do not support generate({', '.join(unsupported)}=...)")
        version = self.refresh()
        first = self.engine.generate(prompts, n, min(self.chunk, max_new_tokens), temperature, top_p, seed)
        rows = [
            (prompts[i], VersionedCompletion(c.token_ids, c.logprobs, c.finished,
                                             versions=[version] * len(c.token_ids)))
            for i, group in enumerate(first)
            for c in group
        ]
        k = 0
        while live := [(p, c) for p, c in rows if not c.finished and len(c.token_ids) < max_new_tokens]:
            k += 1
            version = self.refresh()
            budget = min(self.chunk, max_new_tokens - min(len(c.token_ids) for _, c in live))
            outs = self.engine.generate([p + c.token_ids for p, c in live], 1, budget, temperature, top_p,
                                        seed + k * CHUNK_SEED_STRIDE)
            for (_, c), (more,) in zip(live, outs, strict=True):
                take = more.token_ids[: max_new_tokens - len(c.token_ids)]
                c.token_ids += take
                c.logprobs += more.logprobs[: len(take)]
                c.versions += [version] * len(take)
                c.finished = bool(take) and take[-1] in self.stop_ids
        completions = [c for _, c in rows]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]
