"""The reference generation engine: batched sampling on transformers/torch with a KV cache.

Two things make it faster than ``model.generate`` for RL groups: each prompt is prefilled once and its KV
cache is repeated for the G samples of its group, and rows that have finished are dropped from the batch
instead of being decoded further as padding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.engines import llama_decode, native
from polyrl.engines.kv_cache import preallocate
from polyrl.models.device import module_device, to_device, to_host_lists
from polyrl.models.forward import decoder_forward, full_attention_only


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each sampled token under the sampling distribution (logits / temperature)."""
    finished: bool
    """True when the completion ended with a stop token, False when cut at max_new_tokens."""
    entropies: list[float] | None = None
    """Entropy of the sampling distribution at each token (only when ``generate(entropy=True)``)."""
    stopped: bool = False
    """True when the caller's ``stop`` predicate ended the completion early."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """The k most likely tokens at each step, with their log-probs under the sampling distribution (only when
    ``generate(top_logprobs=k)``)."""


StopFn = Callable[[list[int], list[int], list[float], list[float] | None], list[bool]]
"""``stop(rows, tokens, logprobs, entropies) -> flags``: called after each decoding step with the output rows
still alive (``prompt * n + sample``), the token each just sampled and its log-prob (and entropy); rows
flagged True end there. A hook with ``reads_entropy = False`` gets None for the entropies unless
``generate(entropy=True)``: they cost a softmax over the vocabulary per row and step."""


def sampling_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row (temperature 0 reads as 1)."""
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def top_logprobs_of(logits: torch.Tensor, temperature: float, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the ``k`` most likely tokens and their log-probs under softmax(logits / temperature) (temperature
    0, greedy, reads as 1: the log-probs ``sample_tokens`` reports)."""
    values, ids = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1).topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    native_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; temperature 0 is greedy. Returns (tokens [B], log-probs [B]).

    Sampling inverts each row's CDF at one uniform draw, so a step draws B random numbers. ``torch.multinomial``
    draws one exponential per vocabulary entry instead (B x 49152 for SmolLM2), which on a CPU cost more than
    the whole decoder step at batch 16. With ``native_kernel`` (and no nucleus) the same inversion runs as one
    C++ kernel (``engines/native``), at the same uniform draw.
    """
    if temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    u = torch.rand((logits.shape[0], 1), generator=generator, dtype=logits.dtype, device=logits.device)
    if native_kernel and top_p >= 1.0 and logits.dtype == torch.float32:  # it divides by the temperature itself
        return native.ops().sample_inverse_cdf(logits.contiguous(), u, temperature)
    scaled = logits / temperature if temperature != 1.0 else logits
    if top_p < 1.0:
        logprobs = torch.log_softmax(scaled, dim=-1)
        sorted_probs, order = logprobs.exp().sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        kept = sorted_probs.cumsum(-1) - sorted_probs <= top_p
        picked = inverse_cdf(sorted_probs * kept, u, kept.sum(-1, keepdim=True) - 1)
        tokens = order.gather(-1, picked).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    # Unnormalised weights exp(x - max): the softmax without its division, log-probs from the same sums.
    top = scaled.amax(-1, keepdim=True)
    weights = (scaled - top).exp_()
    tokens, total = blocked_inverse_cdf(weights, u)
    return tokens, (scaled.gather(-1, tokens[:, None]) - top - total.log()).squeeze(-1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, last: torch.Tensor | int) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i] per row ([B, 1]); zero-weight entries are never chosen.

    ``last`` caps the index for the (float-rounding) case u * total == total. The float32 running sum moves each
    entry's share by at most about 1e-7 absolute.
    """
    cdf = weights.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return torch.minimum(idx, torch.as_tensor(last))


def _last_positive(cdf: torch.Tensor) -> torch.Tensor:
    """Index of each row's last entry with weight, from its running sum ([B, 1])."""
    return (cdf < cdf[:, -1:]).sum(-1, keepdim=True)


def blocked_inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``inverse_cdf`` in two levels: the block of ``block`` entries holding u * total from the blocks' sums,
    then the entry within that block. A running sum over the whole 49k vocabulary is one sequential pass per row;
    block sums vectorise, and the two running sums left are 1/256 of it. Returns (index [B], total [B, 1]);
    zero-weight entries are never chosen."""
    b, v = weights.shape
    pad = -v % block
    blocks = (F.pad(weights, (0, pad)) if pad else weights).view(b, -1, block)
    cdf = blocks.sum(-1).cumsum(-1)
    total = cdf[:, -1:]
    target = u * total
    j = torch.minimum(torch.searchsorted(cdf, target, right=True), _last_positive(cdf))
    before = torch.where(j > 0, cdf.gather(-1, (j - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, j[:, :, None].expand(-1, -1, block)).squeeze(1).cumsum(-1)
    k = torch.minimum(torch.searchsorted(inner, target - before, right=True), _last_positive(inner))
    return (j * block + k).squeeze(-1), total


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` with floating-point tensors in bfloat16, the same as
    ``deepcopy(model).to(torch.bfloat16)`` but without first duplicating the float32 weights (which would raise
    the process's peak memory by a full model): deepcopy takes each tensor from a memo filled with its bf16 copy.
    Tied weights stay tied (one memo entry per tensor); every tensor stays on the device it is on."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = b.to(torch.bfloat16) if b.is_floating_point() else b.clone()
    return copy.deepcopy(model, memo).eval().requires_grad_(False)


class HFEngine:
    """Samples from ``policy``.

    With ``bf16_weights`` the engine keeps its own bfloat16 copy of the policy (and a float32 copy of the
    output head), refreshed by ``sync()`` after each update: decoding reads half the bytes per token, which
    is what bounds it on a CPU. Without it, the engine samples from the policy's own weights (under bf16
    autocast when ``bf16``) and ``sync()`` has nothing to do.

    With ``bf16_weights`` and ``fast_decode`` on a Llama-family policy on the CPU, that copy is the fused one of
    ``llama_decode.LlamaDecoder`` and prefill and decoding run through it instead of the transformers model.
    Without either bf16 setting the same decoder runs in float32 when the native kernels are there, reading the
    float32 policy's own weights (no copy; ``sync()`` merges LoRA deltas again). With ``bf16_weights`` on a CPU
    without native bf16 matmuls it runs in float32 too, on its bf16 copy widened to float32 in registers.
    With ``int8_weights`` it runs in float32 on per-row int8 copies of the matrices (``engines/int8.py``),
    re-quantised by ``sync()``; a policy the fused float32 path cannot run is refused (ValueError).

    The engine runs on the policy's device. On a GPU it takes the transformers path (the fused path and the
    native kernels are CPU code), samples on the GPU from a generator there, and copies one step's results to
    the host once; its token streams differ from the CPU's for the same seed (another generator).
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        bf16: bool = True,
        bf16_weights: bool = False,
        preallocate_cache: bool = True,
        fast_decode: bool = True,
        native_kernels: bool = True,
        int8_weights: bool = False,
    ) -> None:
        self.policy = policy
        # False keeps transformers' growing DynamicCache: the reference the preallocated one is tested against.
        self.preallocate_cache = preallocate_cache
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id}
        self.head_weight: torch.Tensor | None = None
        self.device = module_device(policy)
        on_cpu = self.device.type == "cpu"
        self.native_sampling = on_cpu and native_kernels and native.available()
        # Decode steps on a GPU get their mask as the [B, 1, 1, K] boolean transformers would build, because
        # building it there reads the mask back to the host (is it all ones?) once per step. Only where every
        # layer attends to all positions: windowed layers need transformers' own masks.
        self.mask_4d = not on_cpu and full_attention_only(policy)
        self.fast: llama_decode.LlamaDecoder | None = None
        self.rebuild_on_use = False
        """Released with ``until_used``: the next decode syncs first."""
        fused = fast_decode and on_cpu and llama_decode.supports(policy)
        # The fused decoder in float32 on the native kernels: on the policy's own float32 weights, or, for
        # bf16_weights where the CPU has no native bf16 matmuls, on a bf16 copy widened to float32 in registers.
        float32_decoder = fused and self.native_sampling and llama_decode.float32_weights(policy)
        weights = None
        if int8_weights:  # quantised copies of the matrices, whatever the policy's dtype (LoRA merged first)
            if not (fused and self.native_sampling):
                raise ValueError("engine.int8_weights: needs the fused decode path on the native kernels: a "
                                 "Llama-family policy (llama, mistral, qwen2) on the CPU, engine.fast_decode, "
                                 "engine.native_kernels and a C++ compiler")
            weights = torch.int8
        elif float32_decoder and bf16_weights and not llama_decode.computes_bf16():
            weights = torch.bfloat16
        elif float32_decoder and not bf16_weights and not bf16:
            weights = torch.float32
        if weights is not None or (fused and bf16_weights):
            head = policy.get_output_embeddings().weight.detach()
            # A copy, refreshed by sync; float32 for int8 (its largest logits are rescored in float32).
            self.head_weight = head if weights == torch.float32 else head.to(
                torch.float32 if weights == torch.int8 else head.dtype, copy=True)
            self.fast = llama_decode.LlamaDecoder(
                policy, self.head_weight, torch.bfloat16 if weights is None else torch.float32,
                native_kernels=native_kernels, weight_dtype=weights,
            )
            self.model, self.bf16 = policy, False
        elif bf16_weights:
            self.model = bf16_copy(policy)
            self.head_weight = policy.get_output_embeddings().weight.detach().clone()
            self.bf16 = False  # weights are already bf16; autocast would only add casts
        else:
            self.model = policy
            self.bf16 = bf16

    def _head_dtype(self, head: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fast is not None and self.fast.weight_dtype == torch.int8 else head.dtype

    def release_memory(self, until_used: bool = False) -> None:
        """Free the fused decode path's copy of the weights until ``sync``, which rebuilds it layer by layer
        anyway: the learner's update, the step's highest memory, then runs without a second copy of the model.
        A decode while released fails, unless ``until_used``: then it rebuilds the copy first (held-out
        evaluation releases it, and a task may still sample from this engine, e.g. a self-play opponent).
        A no-op on the other paths (their copy is updated in place, or shared with the policy)."""
        if self.fast is not None:
            self.fast.release()
            self.head_weight = self.fast.head_weight = None
            self.rebuild_on_use = until_used

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the policy's current weights into the engine (a no-op when they are shared)."""
        if self.fast is not None:
            head = self.policy.get_output_embeddings().weight
            if self.fast.shares_weights:  # the policy's own head, read in place
                self.head_weight = self.fast.head_weight = head.detach()
            elif self.head_weight is None:  # released for the update
                self.head_weight = self.fast.head_weight = head.detach().to(self._head_dtype(head), copy=True)
            else:
                self.head_weight.copy_(head)
            self.fast.refresh(self.policy)
            return
        if self.model is self.policy:
            return
        for dst, src in zip(self.model.parameters(), self.policy.parameters(), strict=True):
            dst.copy_(src)
        self.head_weight.copy_(self.policy.get_output_embeddings().weight)

    def _last_logits(self, input_ids, mask, positions, cache):
        hidden, cache = decoder_forward(
            self.model, input_ids, mask, positions, self.bf16, cache, use_cache=True
        )
        hidden = hidden[:, -1].float()
        if self.head_weight is not None:
            return F.linear(hidden, self.head_weight), cache
        return self.model.get_output_embeddings()(hidden), cache

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: StopFn | None = None,
        entropy: bool = False,
        top_logprobs: int = 0,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt; result[i][j] is the j-th sample of prompt i.

        ``stop`` may end rows early (see ``StopFn``); ``entropy`` records each token's sampling entropy,
        ``top_logprobs`` the k most likely tokens at each step. None of them changes the tokens sampled while a
        row lives.
        """
        if self.rebuild_on_use and self.head_weight is None:
            self.sync()
        was_training = self.model.training
        if was_training:  # a walk over every module: skipped when the model is already in eval mode
            self.model.eval()
        try:
            flat = self._generate(prompts, n, max_new_tokens, temperature, top_p, seed, stop, entropy, top_logprobs)
        finally:
            if was_training:
                self.model.train()
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, seed, stop=None, entropy=False, top_k_lp=0):
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.device.type != "cpu":  # laid out on the host, copied once
            input_ids, mask, positions = (t.to(self.device, non_blocking=True) for t in (input_ids, mask, positions))
        generator = torch.Generator(device=self.device).manual_seed(seed)

        if self.fast is not None:
            logits, cache = self.fast.prefill(input_ids, mask, positions)  # its buffers size themselves
        else:
            logits, cache = self._last_logits(input_ids, mask, positions, None)
            if self.preallocate_cache:  # the cache grows by doubling if answers run longer
                cache = preallocate(cache, width + min(max_new_tokens, 128))
        if n > 1:
            # One prefill per prompt; its KV cache is shared by the group's samples.
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, 0)
            mask = mask.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        # The attention mask grows by a column of ones per step: slices of one buffer instead of a cat per step.
        mask_buf = torch.ones((mask.shape[0], width + max_new_tokens), dtype=mask.dtype, device=mask.device)
        mask_buf[:, :width] = mask
        next_pos = positions[:, -1] + 1
        total = len(prompts) * n
        rows = list(range(total))  # which output row each live batch row belongs to
        tokens: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        finished = [False] * total
        stopped = [False] * total
        ents: list[list[float]] | None = [[] for _ in range(total)] if entropy else None
        reads_entropy = stop is not None and getattr(stop, "reads_entropy", True)
        tops: list[list[list[tuple[int, float]]]] | None = [[] for _ in range(total)] if top_k_lp else None

        for step in range(max_new_tokens):
            tok, lp = sample_tokens(logits, temperature, top_p, generator, self.native_sampling)
            ent = sampling_entropy(logits, temperature) if (entropy or reads_entropy) else None
            # The step's one wait for the device: tokens, log-probs (and entropies) in one copy.
            tok_list, lp_list, *ent_lists = to_host_lists(tok, lp, *([ent] if ent is not None else []))
            ent_list = ent_lists[0] if ent_lists else None
            top_list = top_logprobs_of(logits, temperature, top_k_lp) if tops is not None else None
            flags = stop(rows, tok_list, lp_list, ent_list) if stop is not None else None
            alive = []
            for b, (row, t, logp) in enumerate(zip(rows, tok_list, lp_list, strict=True)):
                tokens[row].append(t)
                logps[row].append(logp)
                if ents is not None:
                    ents[row].append(ent_list[b])
                if tops is not None:
                    tops[row].append(top_list[b])
                if t in self.stop_ids:
                    finished[row] = True
                elif flags is not None and flags[b]:
                    stopped[row] = True
                else:
                    alive.append(b)
            if not alive or step == max_new_tokens - 1:
                break
            if len(alive) < len(rows):
                keep = to_device(alive, self.device)
                cache.batch_select_indices(keep)
                tok, mask_buf, next_pos = tok[keep], mask_buf[keep], next_pos[keep]
                rows = [rows[b] for b in alive]
            mask = mask_buf[:, : width + step + 1]
            if self.fast is not None:
                logits = self.fast.decode(tok, mask, next_pos, cache)
            else:
                step_mask = mask[:, None, None, :].bool() if self.mask_4d else mask
                logits, cache = self._last_logits(tok[:, None], step_mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return [
            Completion(tokens[i], logps[i], finished[i], ents[i] if ents is not None else None, stopped[i],
                       tops[i] if tops is not None else None)
            for i in range(total)
        ]
