"""Behaviour log-probs recomputed with the learner's policy, for engines whose numerics differ from it.

An engine such as vLLM samples with its own kernels (bf16 weights, fused attention, its own head); the
log-probs it reports for a sampled token can drift from what the learner's float32-head forward gives for the
same token. ``engine.recompute_logprobs`` replaces them with the policy's own, so the PPO ratio and the KL start
from the learner's numbers (the tokens themselves stay exactly as sampled).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from polyrl.engines.hf import Completion
from polyrl.models.device import module_device
from polyrl.models.forward import forward_logits


@torch.no_grad()
def policy_logprobs(
    policy: PreTrainedModel,
    prompt: list[int],
    completions: list[list[int]],
    temperature: float,
    bf16: bool,
    pad_id: int,
) -> list[list[float]]:
    """Log-probs of each completion's tokens after ``prompt`` under softmax(logits / temperature) of ``policy``
    (temperature 0 means the plain softmax, as the HF engine's greedy path reports)."""
    width = max((len(c) for c in completions), default=0)
    if width == 0:
        return [[] for _ in completions]
    rows = len(completions)
    total = len(prompt) + width
    ids = torch.full((rows, total), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, total), dtype=torch.long)
    for i, c in enumerate(completions):
        seq = prompt + c
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1  # right padding: positions are plain 0..T-1 for every row
    positions = torch.arange(total).expand(rows, total)
    device = module_device(policy)
    if device.type != "cpu":  # laid out on the host, copied once
        ids, mask, positions = (t.to(device, non_blocking=True) for t in (ids, mask, positions))
    was_training = policy.training
    policy.eval()
    try:
        # The logits at position t predict token t + 1: keep the last ``width`` + 1 and drop the final one.
        logits, _ = forward_logits(policy, ids, mask, positions, width + 1, bf16)
    finally:
        policy.train(was_training)
    logits = logits[:, :-1]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    targets = ids[:, len(prompt) :]
    picked = logp.gather(-1, targets[..., None]).squeeze(-1).cpu()  # one copy back, not one per row
    return [picked[i, : len(c)].tolist() for i, c in enumerate(completions)]


class RecomputeLogprobs:
    """Wraps an engine: same ``generate`` and ``sync``, but each completion's log-probs come from ``policy``."""

    def __init__(self, engine: Any, policy: PreTrainedModel, bf16: bool) -> None:
        self.engine = engine
        self.policy = policy
        self.bf16 = bf16

    def __getattr__(self, name: str) -> Any:
        # tokenizer, stop_ids, pad_id ... are the wrapped engine's.
        return getattr(self.engine, name)

    def sync(self) -> None:
        self.engine.sync()

    def release_memory(self, until_used: bool = False) -> None:
        self.engine.release_memory(until_used)

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        **hooks: Any,
    ) -> list[list[Completion]]:
        groups = self.engine.generate(prompts, n, max_new_tokens, temperature, top_p, seed, **hooks)
        for prompt, group in zip(prompts, groups, strict=True):
            fresh = policy_logprobs(
                self.policy, prompt, [c.token_ids for c in group], temperature, self.bf16, self.engine.pad_id
            )
            for c, lp in zip(group, fresh, strict=True):
                c.logprobs = lp
        return groups
