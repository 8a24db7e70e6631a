"""The learner: turns scored trajectories into one optimizer update.

Batches are laid out as [left-padded prompt | right-padded response], so the output head runs only on
response positions and every sequence's first model token sits in the same column.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from polyrl.algorithms import LOSSES, aggregate, kl_estimate
from polyrl.config import AlgorithmConfig, OptimConfig
from polyrl.models.forward import forward_logits
from polyrl.types import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, R] token ids at response positions
    loss_mask: torch.Tensor  # [B, R]
    behaviour_logp: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B]

    @property
    def response_len(self) -> int:
        return self.targets.shape[1]

    def rows(self, idx: slice) -> Batch:
        return Batch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    starts = [t.prompt_len for t in trajectories]
    width_left = max(starts)
    width_right = max(len(t.input_ids) - s for t, s in zip(trajectories, starts, strict=True))
    b, length = len(trajectories), width_left + width_right
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, width_right), dtype=torch.float32)
    behaviour = torch.zeros((b, width_right), dtype=torch.float32)
    for i, (t, s) in enumerate(zip(trajectories, starts, strict=True)):
        n_resp = len(t.input_ids) - s
        lo, hi = width_left - s, width_left + n_resp
        input_ids[i, lo:hi] = torch.tensor(t.input_ids)
        attn[i, lo:hi] = 1
        loss_mask[i, :n_resp] = torch.tensor(t.loss_mask[s:], dtype=torch.float32)
        behaviour[i, :n_resp] = torch.tensor(t.logprobs[s:], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        targets=input_ids[:, width_left:],
        loss_mask=loss_mask,
        behaviour_logp=behaviour,
        advantages=torch.tensor([t.advantage for t in trajectories], dtype=torch.float32),
    )


def token_logprobs(
    model: PreTrainedModel, batch: Batch, temperature: float, bf16: bool, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens under logits / temperature (the sampling distribution), and the
    per-token entropy of that distribution (differentiable only when ``entropy_grad``)."""
    r = batch.response_len
    logits, _ = forward_logits(model, batch.input_ids, batch.attention_mask, batch.position_ids, r + 1, bf16)
    logits = logits[:, :-1] / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, batch.targets[..., None]).squeeze(-1) - log_z
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


class Learner:
    def __init__(
        self,
        model: PreTrainedModel,
        algo: AlgorithmConfig,
        optim: OptimConfig,
        temperature: float,
        bf16: bool,
        pad_id: int,
    ) -> None:
        self.model = model
        self.algo = algo
        self.optim_cfg = optim
        self.temperature = temperature
        self.bf16 = bf16
        self.pad_id = pad_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.is_lora = hasattr(model, "disable_adapter")
        self.wants_reference = algo.kl_coef > 0 or algo.track_kl
        # The KL reference: with LoRA, the same weights with adapters off; otherwise a frozen copy.
        self.ref_model = None
        if self.wants_reference and not self.is_lora:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def _reference_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.is_lora:
            with self.model.disable_adapter():
                return self._logprobs(batch)[0]
        return token_logprobs(self.ref_model, batch, self.temperature, self.bf16)[0]

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One optimisation round (``algo.epochs`` passes over the batch, one optimizer step each)."""
        algo, micro = self.algo, self.optim_cfg.micro_batch_size
        self.model.train()
        batch = collate(trajectories, self.pad_id)
        chunks = [slice(i, i + micro) for i in range(0, len(trajectories), micro)]
        num_tokens = float(batch.loss_mask.sum().clamp(min=1))
        ref = [self._reference_logprobs(batch.rows(c)) for c in chunks] if self.wants_reference else None
        old = None
        if algo.epochs > 1:  # several passes need the pre-update policy's log-probs fixed up front
            with torch.no_grad():
                old = [self._logprobs(batch.rows(c))[0] for c in chunks]
        loss_fn = LOSSES[algo.loss]
        totals: dict[str, float] = {}  # summed over micro-batches (they add up to the batch loss)
        means: dict[str, float] = {}  # averaged over micro-batches
        for _ in range(algo.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for k, c in enumerate(chunks):
                mb = batch.rows(c)
                # token-mean shares the global token count; the seq-mean modes weight by sequences.
                share = 1.0 if algo.loss_agg == "token-mean" else mb.targets.shape[0] / len(trajectories)
                logp, entropy = self._logprobs(mb, entropy_grad=algo.entropy_coef != 0)
                old_logp = old[k] if old is not None else logp.detach()
                pg_loss, m = loss_fn(
                    logp, old_logp, mb.advantages, mb.loss_mask, clip_low=algo.clip_low,
                    clip_high=algo.clip_high, agg=algo.loss_agg, num_tokens=num_tokens,
                )
                ent = aggregate(entropy, mb.loss_mask, algo.loss_agg, num_tokens) * share
                loss = pg_loss * share - algo.entropy_coef * ent
                parts = {"loss/pg": float(pg_loss.detach()) * share, "entropy": float(ent.detach())}
                if ref is not None:
                    kl = aggregate(kl_estimate(logp, ref[k], algo.kl_estimator), mb.loss_mask, algo.loss_agg, num_tokens)
                    parts["kl"] = float(kl.detach()) * share
                    if algo.kl_coef > 0:
                        loss = loss + algo.kl_coef * kl * share
                loss.backward()
                parts["loss"] = float(loss.detach())
                for key, v in parts.items():
                    totals[key] = totals.get(key, 0.0) + v / algo.epochs
                for key, v in m.items():
                    means[key] = means.get(key, 0.0) + v / (algo.epochs * len(chunks))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.grad_clip))
            if math.isfinite(grad_norm):
                self.optimizer.step()
            else:  # a NaN/inf gradient must not reach the weights
                self.optimizer.zero_grad(set_to_none=True)
                totals["skipped_updates"] = totals.get("skipped_updates", 0.0) + 1
            means["grad_norm"] = means.get("grad_norm", 0.0) + grad_norm / algo.epochs
        self.scheduler.step()
        totals.setdefault("kl", None)  # not measured: no reference was kept (kl_coef 0, track_kl off)
        totals.setdefault("skipped_updates", 0.0)
        return {**totals, **means, "lr": self.scheduler.get_last_lr()[0]}

    def _logprobs(self, batch: Batch, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.model, batch, self.temperature, self.bf16, entropy_grad)
