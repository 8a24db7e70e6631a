"""Tinker sampling on polyrl's engine: a frozen snapshot of a model's weights, sampled by ``HFEngine`` and
scored (prompt log-probs) by the same snapshot.

A snapshot is a plain model: LoRA adapters are merged into a copy of the weights, and an adapted output head is
first given a weight of its own (SmolLM2's head shares its weight with the input embedding), so the engine's
fast decode path and the scorer compute the trained model, head included. Later optimizer steps do not touch
it: a sampling client samples from the weights it was saved from, as Tinker's snapshots do.

Stop conditions are Tinker's: ``stop=None`` ends at the tokenizer's end-of-sequence token, a list of token ids
or strings ends at any of them (end-of-sequence still ends it), ``stop=[]`` only at ``max_tokens``. The tokens
that completed a stop condition are part of the returned sequence, with their log-probs. Log-probs are those of
the sampling distribution (logits / temperature), which is the learner's (temperature 1) when sampling at
temperature 1.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.engines.hf import HFEngine
from polyrl.learner.logprobs import chunked_logprobs
from polyrl.models.forward import decoder_forward
from polyrl.tinker_api import wire
from polyrl.tinker_api.wire import WireError

MAX_BATCH_ROWS = 64
"""Sample rows (prompts x samples) one engine call decodes together at most."""


@dataclass(frozen=True)
class StopRule:
    token_ids: frozenset[int]
    strings: tuple[str, ...] = ()

    def hit(self, generated: list[int], tokenizer: PreTrainedTokenizerBase) -> bool:
        if generated[-1] in self.token_ids:
            return True
        if not self.strings:
            return False
        window = max(len(s) for s in self.strings) + 8  # a token holds at least one character, but for specials
        text = tokenizer.decode(generated[-window:], skip_special_tokens=False)
        return any(s in text for s in self.strings)


def stop_rule(stop: str | Sequence[str] | Sequence[int] | None, eos_id: int | None) -> StopRule:
    eos = frozenset() if eos_id is None else frozenset({eos_id})
    if stop is None:
        return StopRule(eos)
    if isinstance(stop, str):
        return StopRule(eos, (stop,))
    stop = list(stop)
    if not stop:
        return StopRule(frozenset())
    if all(isinstance(s, int) for s in stop):
        return StopRule(eos | frozenset(stop))
    if all(isinstance(s, str) and s for s in stop):
        return StopRule(eos, tuple(stop))
    raise WireError("sampling_params.stop: a string, a list of non-empty strings or a list of token ids")


@dataclass
class SampleJob:
    """One ``asample`` request, read and checked."""

    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: StopRule
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None
    future: Future = field(default_factory=Future)

    def batch_key(self) -> tuple:
        """Requests with the same key are decoded in one engine call."""
        return self.n, self.max_tokens, self.temperature, self.top_p, self.seed


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A float32 copy of ``model``'s weights without gradients, ties kept, LoRA adapters merged (in float32:
    bfloat16 base weights are widened first)."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=False)
    snapshot = copy.deepcopy(model, memo)
    if hasattr(snapshot, "merge_and_unload"):
        head = snapshot.get_output_embeddings()
        base = getattr(head, "base_layer", None)
        if base is not None and base.weight is snapshot.get_input_embeddings().weight:
            # Untie before merging, or the head's delta would be merged into the input embedding too.
            base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
            snapshot.get_base_model().config.tie_word_embeddings = False
        snapshot = snapshot.merge_and_unload()
    return snapshot.eval().requires_grad_(False)


class Sampler:
    """Samples from, and scores prompts under, one snapshot of a model."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, bf16: bool, version: int = 0):
        self.model, self.tokenizer, self.bf16, self.version = model, tokenizer, bf16, version
        self.engine = HFEngine(model, tokenizer, bf16=bf16, bf16_weights=bf16)
        self.engine.stop_ids = set()  # every stop condition is the request's (``StopRule``)
        self.context = getattr(model.config, "max_position_embeddings", None) or math.inf

    def check(self, job: SampleJob) -> None:
        if not job.prompt:
            raise WireError("asample: the prompt is empty")
        if len(job.prompt) + job.max_tokens > self.context:
            raise WireError(f"asample: prompt ({len(job.prompt)} tokens) + max_tokens ({job.max_tokens}) exceeds "
                            f"the model's context of {self.context} tokens")
        vocab = self.model.get_input_embeddings().num_embeddings
        if min(job.prompt) < 0 or max(job.prompt) >= vocab:
            raise WireError(f"asample: prompt token ids must lie in [0, {vocab})")
        if job.prompt_logprobs_last_n is not None and not 1 <= job.prompt_logprobs_last_n < len(job.prompt):
            raise WireError(f"asample: prompt_logprobs_last_n must be between 1 and {len(job.prompt) - 1}")

    def run(self, jobs: list[SampleJob], seed: int) -> list[bytes]:
        """Sample every job (all with the same ``batch_key``) in one engine call; the protobuf responses."""
        n = jobs[0].n
        generated: dict[int, list[int]] = {}

        def stop(rows, tokens, logprobs, entropies):
            flags = []
            for row, token in zip(rows, tokens, strict=True):
                seq = generated.setdefault(row, [])
                seq.append(token)
                flags.append(jobs[row // n].stop.hit(seq, self.tokenizer))
            return flags

        stop.reads_entropy = False
        first = jobs[0]
        completions = self.engine.generate([j.prompt for j in jobs], n=n, max_new_tokens=first.max_tokens,
                                           temperature=first.temperature, top_p=first.top_p, seed=seed, stop=stop)
        out = []
        for job, samples in zip(jobs, completions, strict=True):
            sequences = [wire.Sequence(c.token_ids, c.logprobs, c.stopped) for c in samples]
            out.append(wire.sample_response(sequences, self.prompt_logprobs(job) if job.prompt_logprobs else None))
        return out

    @torch.no_grad()
    def prompt_logprobs(self, job: SampleJob) -> list[float]:
        """Log-prob of each prompt token given those before it (NaN for the first, and before the last n)."""
        ids = torch.tensor([job.prompt], device=next(self.model.parameters()).device)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        hidden, _ = decoder_forward(self.model, ids, torch.ones_like(ids), positions, self.bf16)
        scores, _ = chunked_logprobs(self.model, hidden[:, :-1], ids[:, 1:], 1.0)
        values = [math.nan] + scores[0].tolist()
        if job.prompt_logprobs_last_n is not None:
            keep = job.prompt_logprobs_last_n
            values = [math.nan] * (len(values) - keep) + values[-keep:]
        return values
