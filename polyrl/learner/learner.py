"""The learner: turns scored trajectories into one optimizer update (batches: ``learner/batch.py``; log-probs:
``learner/logprobs.py``, the body's forward pass in ``learner/forward_pass.py``)."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from polyrl.algorithms.entropy_control import adaptive_entropy_coef
from polyrl.algorithms.gae import ValueHead
from polyrl.algorithms.losses import ADVANTAGE_WEIGHTED, LOSSES
from polyrl.algorithms.mismatch import mismatch_sums
from polyrl.algorithms.validate import anchor_topk_size
from polyrl.config import AlgorithmConfig, LearnerConfig, OptimConfig
from polyrl.learner.advantage_stage import token_advantages
from polyrl.learner.batch import Batch, collate
from polyrl.learner.logprobs import response_logits
from polyrl.learner.loss_terms import LOSS_TERMS, LossInputs
from polyrl.learner.optimizer import load_optimizer_state, make_optimizer, optimizer_state, schedule_step
from polyrl.learner.policy_pass import PolicyPass
from polyrl.learner.task_gradients import combine, put_local_grads, take_local_grads
from polyrl.learner.update_metrics import UpdateMetrics, add_sums
from polyrl.models.forward import enable_activation_checkpointing
from polyrl.parallel.fsdp import clip_grad_norm, shard_module
from polyrl.parallel.group import balanced_shards
from polyrl.plan import Ranks
from polyrl.types import Trajectory


@dataclass
class _Plan:
    """One update's micro-batches on this rank and what every pass over them reads."""

    micro_batches: list[Batch]
    chunks: list[torch.Tensor]
    """Each micro-batch's rows in the sorted batch."""
    real: list[bool]
    """False for a placeholder pass (a rank with less work still joins each collective)."""
    real_total: int
    """Real micro-batches over all ranks."""
    ref: list[torch.Tensor] | None
    """The KL reference's log-probs per micro-batch, when kept."""
    old: list[tuple[torch.Tensor, torch.Tensor | None]] | None
    """Log-probs and values before the update, when there are several epochs."""
    old_topk: list[tuple[torch.Tensor, torch.Tensor]] | None
    """The top-k token ids and log-probs before the update, when there are several epochs and the loss
    reads them (DPPO's top-k divergence)."""
    rewards: torch.Tensor
    cross: torch.Tensor
    """[N] bool: rows another policy sampled (``rollout.cross_policy``)."""
    tasks: list[str]
    n_rows: int
    num_tokens: float


def detach(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach()


class Learner:
    def __init__(
        self,
        model: PreTrainedModel,
        algo: AlgorithmConfig,
        optim: OptimConfig,
        temperature: float,
        bf16: bool,
        pad_id: int,
        total_steps: int = 0,
        teachers: dict[str, PreTrainedModel] | None = None,
        is_cap: float = 2.0,
        sharding: LearnerConfig | None = None,
        replay_is_cap: float = 1.0,
        shaping_gamma: float | None = None,
        fsdp: bool | None = None,
        ranks: Ranks = Ranks(),
    ) -> None:
        """``total_steps`` is the run's length, over which a decaying learning-rate schedule reaches 0;
        ``teachers`` maps a task name to its frozen distillation teacher (``regularisers.distill_coef`` weighs it).
        With several ``ranks`` (the run plan's; this process's place in the joined group) the policy and the
        KL reference are sharded with FSDP2 as ``sharding`` says, and each update trains this rank's share of
        the batch. ``fsdp=True`` shards under a process group of one rank too (the GPU check runs FSDP2 on one
        GPU); None shards when there are several ranks."""
        self.model = model
        self.teachers = teachers or {}
        self.is_cap = is_cap  # truncated IS cap for rows sampled by another policy (info["cross_policy"])
        self.replay_is_cap = replay_is_cap  # truncation of replayed samples' importance weights (agents.replay)
        self.shaping_gamma = shaping_gamma  # LUFFY's policy shaping of reference tokens (guidance)
        self.algo = algo
        self.optim_cfg = optim
        self.temperature = temperature
        self.bf16 = bf16
        self.pad_id = pad_id
        self.ranks = ranks
        self.device = next(model.parameters()).device
        self.is_lora = hasattr(model, "disable_adapter")
        self.wants_reference = algo.regularisers.kl_coef > 0 or algo.regularisers.track_kl
        # The entropy bonus's weight: regularisers.entropy_coef, moved each step under entropy_target.
        self.entropy_coef = algo.regularisers.entropy_coef
        self.anchor_topk = anchor_topk_size(LOSSES[algo.loss.name], algo.loss.kwargs)
        # The KL reference: with LoRA, the same weights with adapters off; otherwise a frozen copy.
        self.ref_model = None
        if self.wants_reference and not self.is_lora:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        # PPO's critic: a value head on the policy's (detached) final hidden states, in its own param group.
        self.value_head: ValueHead | None = None
        if algo.critic is not None:
            self.value_head = ValueHead(model.get_output_embeddings().in_features, algo.critic.width).to(self.device)
        self.policy_pass = PolicyPass(model, temperature, bf16, self.value_head)
        self.ref_pass = PolicyPass(self.ref_model, temperature, bf16) if self.ref_model is not None else None
        if self.ranks.distributed if fsdp is None else fsdp:
            sharding = sharding or LearnerConfig()
            for module in (self.policy_pass, self.ref_pass):
                if module is not None:
                    shard_module(module, module.policy, self.device, ranks.world_size, sharding.offload_optimizer,
                                 sharding.activation_checkpointing and module is self.policy_pass)
        elif sharding is not None and sharding.activation_checkpointing:  # one process: recompute, no sharding
            enable_activation_checkpointing(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups: list[dict] = [{"params": self.params}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": algo.critic.lr, "weight_decay": 0.0})
        self.optimizer, self.scheduler = make_optimizer(groups, optim, total_steps)

    @property
    def share_prefix(self) -> bool:
        """Run a group's shared prompt once (``response_hidden``); off only to measure what that saves."""
        return self.policy_pass.share_prefix

    @share_prefix.setter
    def share_prefix(self, value: bool) -> None:
        for module in (self.policy_pass, self.ref_pass):
            if module is not None:
                module.share_prefix = value

    def state_dict(self) -> dict:
        """What a checkpoint needs besides the policy weights: optimizer, scheduler, the critic, if any, and
        the learner's own small state (``own_state``)."""
        state = optimizer_state(self.optimizer, self.scheduler)
        if self.value_head is not None:
            state["value_head"] = self.value_head.state_dict()
        return {**state, **self.own_state()}

    def own_state(self) -> dict[str, float]:
        """The learner's state that is neither weights nor optimizer: the entropy coefficient when
        ``regularisers.entropy_target`` moves it (empty otherwise). Plain numbers, so a sharded checkpoint
        keeps them in its JSON trainer state."""
        return {"entropy_coef": self.entropy_coef} if self.algo.regularisers.entropy_target is not None else {}

    def load_own_state(self, state: dict) -> None:
        """Restore ``own_state``. A checkpoint of a run without ``entropy_target`` starts the coefficient at
        ``regularisers.entropy_coef``; a run without it keeps that fixed value whatever was saved."""
        if self.algo.regularisers.entropy_target is not None and "entropy_coef" in state:
            self.entropy_coef = float(state["entropy_coef"])

    def load_state_dict(self, state: dict) -> None:
        if (self.value_head is not None) != ("value_head" in state):
            have = "has a value head" if "value_head" in state else "has no value head"
            raise ValueError(f"checkpoint {have}, but algorithm.critic is {'set' if self.algo.critic else 'not set'}")
        load_optimizer_state(self.optimizer, self.scheduler, state)
        if self.value_head is not None:
            self.value_head.load_state_dict(state["value_head"])
        self.load_own_state(state)

    @torch.no_grad()
    def _reference_logprobs(self, batch: Batch) -> torch.Tensor:
        return (self.ref_pass or self.policy_pass)(batch, reference=True)[0]

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One optimisation round (``algo.loss.epochs`` passes over the batch, one optimizer step each)."""
        algo = self.algo
        self.model.train()
        # Micro-batches hold whole groups of similar prompt length, then similar response lengths: each pads
        # only to its own longest prompt and response, and computes each shared prompt once (not once per
        # micro-batch that one of its rows lands in). Mixed tasks (a 50-token prompt beside a 250-token one
        # with tool instructions) otherwise pad every short row to the long prompt.
        trajectories = sorted(
            trajectories, key=lambda t: (p := t.prompt_len, t.group_id, len(t.input_ids) - p)
        )
        batch = collate(trajectories, self.pad_id)  # on the host: its checks and slicing read no device
        if algo.loss.mask_truncated:  # DAPO overlong filtering: a cut-off answer's reward misjudges its tokens
            keep = torch.tensor([not t.truncated for t in trajectories], dtype=batch.loss_mask.dtype)
            batch.loss_mask = batch.loss_mask * keep[:, None]
        if self._gradient_is_zero(batch):
            return self._step_on_zero_gradient()
        plan, metrics = self._plan(trajectories, batch), UpdateMetrics(algo.loss.epochs)
        task_names = sorted({t.task for t in trajectories})
        grads_cfg = algo.gradients
        per_task = len(task_names) > 1 and (grads_cfg.surgery != "none" or (
            grads_cfg.task_grad_every > 0 and self.scheduler.last_epoch % grads_cfg.task_grad_every == 0))
        task_metrics: dict[str, float] = {}
        for epoch in range(algo.loss.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            if per_task:  # the passes once per task, then the tasks' gradients combined (learner/task_gradients.py)
                grads = []
                for name in task_names:
                    rows = torch.tensor([float(t.task == name) for t in trajectories], device=self.device)
                    self._passes(plan, metrics, epoch, rows, len(task_names))
                    grads.append(take_local_grads(self.params))
                combined, tm = combine(task_names, grads, algo.gradients.surgery, self.scheduler.last_epoch)
                put_local_grads(self.params, combined)
                task_metrics = task_metrics or tm  # the first epoch's: the gradients of the batch as sampled
            else:
                self._passes(plan, metrics, epoch)
            self._optimizer_step(metrics)
        schedule_step(self.scheduler)
        return self._control_entropy(metrics.result(self.ranks, task_metrics, self.scheduler.get_last_lr()[0]))

    def _control_entropy(self, metrics: dict[str, float | None]) -> dict[str, float | None]:
        """Under ``regularisers.entropy_target``, move the entropy coefficient by this update's token-mean
        entropy (the same on every rank: merged over them) for the next one; ``entropy_control/coef`` is the
        coefficient this update's loss used."""
        reg = self.algo.regularisers
        if reg.entropy_target is None:
            return metrics
        used = self.entropy_coef
        self.entropy_coef = adaptive_entropy_coef(used, metrics.get("entropy_control/entropy"), reg.entropy_target,
                                                  reg.entropy_coef_step, reg.entropy_coef_max)
        return {**metrics, "entropy_control/coef": used}

    def _plan(self, trajectories: list[Trajectory], batch: Batch) -> _Plan:
        """This rank's micro-batches of the sorted batch, with what every pass over them reads: the rewards,
        the cross-policy rows, the KL reference's log-probs and, for several epochs, the log-probs and values
        before the update."""
        chunks, real, real_total = self._my_micro_batches(trajectories)
        micro_batches = [batch.rows(c) for c in chunks]  # trimmed once, reused by every pass
        for mb, is_real in zip(micro_batches, real, strict=True):
            if not is_real:  # a placeholder pass that keeps the ranks' collectives in step; it adds nothing
                mb.loss_mask = torch.zeros_like(mb.loss_mask)
        if self.device.type != "cpu":
            micro_batches = [mb.to(self.device) for mb in micro_batches]
            chunks = [c.to(self.device) for c in chunks]
        ref = [self._reference_logprobs(mb) for mb in micro_batches] if self.wants_reference else None
        old = old_topk = None
        if self.algo.loss.epochs > 1:  # several passes need the pre-update log-probs (and values) fixed up front
            with torch.no_grad():
                passes = list(map(self._forward, micro_batches))
            old = [(f[0], f[2]) for f in passes]
            if self.anchor_topk:
                old_topk = [self._topk(f[3]) for f in passes]
        return _Plan(
            micro_batches, chunks, real, real_total, ref, old, old_topk,
            rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=self.device),
            cross=torch.tensor([bool(t.info.get("cross_policy")) for t in trajectories], device=self.device),
            tasks=[t.task for t in trajectories], n_rows=len(trajectories),
            # The whole batch's normaliser: each rank's share of the loss carries it, so the ranks' gradients
            # add up to the gradient of the one-process loss over the whole batch.
            num_tokens=float(batch.loss_mask.sum().clamp(min=1)),
        )

    def _passes(
        self, plan: _Plan, metrics: UpdateMetrics, epoch: int, rows: torch.Tensor | None = None, n_passes: int = 1
    ) -> None:
        """Forward and backward over this rank's micro-batches, adding into the gradients; ``rows``: 0/1 per
        row of the batch, the rows that count (one task's), of ``n_passes`` that make up the batch."""
        algo = self.algo
        for k, (c, mb) in enumerate(zip(plan.chunks, plan.micro_batches, strict=True)):
            if rows is not None:  # one task's passes: the other tasks' rows count for nothing
                mb = dataclasses.replace(mb, loss_mask=mb.loss_mask * rows[c][:, None])
            # token-mean shares the global token count; the seq-mean modes weight by sequences.
            share = 1.0 if algo.loss.agg == "token-mean" else mb.targets.shape[0] / plan.n_rows
            share *= plan.real[k]
            logp, entropy, values, logits = self._forward(mb, entropy_grad=self.entropy_coef != 0)
            old_logp, old_values = plan.old[k] if plan.old is not None else (logp.detach(), detach(values))
            ref_logp = plan.ref[k] if plan.ref is not None else None
            anchor_topk = None
            if self.anchor_topk:  # one epoch: the policy at the update's start is this pass's
                anchor_topk = plan.old_topk[k] if plan.old_topk is not None else self._topk(logits)
            advantages = token_advantages(algo, mb, plan.rewards[c], old_logp, ref_logp, old_values, plan.cross[c],
                                          self.is_cap, self.replay_is_cap)
            if epoch == 0 and plan.real[k]:  # another model's rows (cross-policy) are no engine mismatch
                own = mb.loss_mask * ~(plan.cross[c] | mb.guided)[:, None]
                band = algo.off_policy.mismatch_band
                add_sums(metrics.mismatch, mismatch_sums(old_logp, mb.behaviour_logp, own, band))
            teacher_logits, teacher_rows = self._teacher_logits(mb, logits, [plan.tasks[i] for i in c.tolist()])
            x = LossInputs(mb, logp, entropy, values, logits, ref_logp, old_values, advantages, teacher_logits,
                           teacher_rows, plan.num_tokens, share, anchor_topk, self.shaping_gamma, self.entropy_coef,
                           plan.rewards[c])
            terms = [term(algo, x) for term in LOSS_TERMS]
            loss = sum(t.loss for t in terms if t.loss is not None)  # the terms that are on, in LOSS_TERMS order
            loss.backward()
            if plan.real[k]:
                metrics.add_pass(float(loss.detach()), {key: v for t in terms for key, v in t.logged.items()},
                                 {**advantages.metrics, **{key: v for t in terms for key, v in t.metrics.items()}},
                                 algo.loss.epochs * plan.real_total * n_passes)

    def _optimizer_step(self, metrics: UpdateMetrics) -> None:
        """Clip the gradients and step, unless they are not finite (a NaN/inf must not reach the weights)."""
        grad_norm = clip_grad_norm(self.params, self.optim_cfg.grad_clip)
        if self.value_head is not None:  # clipped apart: a fresh critic's big gradients spare the policy
            clip_grad_norm(list(self.value_head.parameters()), self.optim_cfg.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        metrics.add_step(grad_norm, skipped=not math.isfinite(grad_norm))

    def _my_micro_batches(self, trajectories: list[Trajectory]) -> tuple[list[torch.Tensor], list[bool], int]:
        """This rank's micro-batches (row indices of the sorted batch), whether each is real, and the number of
        real micro-batches over all ranks. Whole groups go to a rank, balanced by tokens (their shared prompt
        runs once there); with fewer groups than ranks, single rows. Every rank runs as many passes as the
        busiest one (each pass gathers the sharded weights, a collective), padding with placeholders."""
        micro, ranks = self.optim_cfg.micro_batch_size, self.ranks
        units: list[list[int]] = []
        for i, t in enumerate(trajectories):
            if units and trajectories[units[-1][-1]].group_id == t.group_id:
                units[-1].append(i)
            else:
                units.append([i])
        if len(units) < ranks.world_size:
            units = [[i] for i in range(len(trajectories))]
        costs = [sum(len(trajectories[i].input_ids) for i in u) for u in units]
        shards = [sorted(i for k in shard for i in units[k]) for shard in balanced_shards(costs, ranks.world_size)]
        counts = [math.ceil(len(shard) / micro) for shard in shards]
        mine = shards[ranks.rank]
        chunks = [torch.tensor(mine[i : i + micro]) for i in range(0, len(mine), micro)]
        real = [True] * len(chunks)
        while len(chunks) < max(counts):  # a rank with less work (fewer rows than ranks) still joins each pass
            chunks.append(torch.tensor(mine[:1] or [0]))
            real.append(False)
        return chunks, real, sum(counts)

    def _gradient_is_zero(self, batch: Batch) -> bool:
        """True when the loss is 0 whatever the weights: every advantage is 0 (e.g. dynamic sampling found no
        group whose rewards differ), the loss weights each token by its advantage, and no other term is on
        (entropy bonus, KL in the loss or the reward, KL tracking, critic, distillation, SFT). GRPO-style runs
        reach this often late in training, when every group agrees. Holding the entropy at a target
        (``entropy_target``) needs it measured every step, so such runs always take the passes."""
        algo = self.algo
        return (
            algo.loss.name in ADVANTAGE_WEIGHTED and not bool(batch.advantages.any())
            and self.entropy_coef == 0 and algo.regularisers.entropy_target is None
            and not self.wants_reference and self.value_head is None
            and not (self.teachers and algo.regularisers.distill_coef > 0) and algo.regularisers.sft_coef == 0
        )

    def _step_on_zero_gradient(self) -> dict[str, float]:
        """The update of a batch whose gradient is exactly 0 (``_gradient_is_zero``), without the forward and
        backward passes that would compute it: the optimizer steps on zero gradients as it would have (AdamW's
        moments decay and the momentum still moves the weights). The entropy is not measured."""
        for _ in range(self.algo.loss.epochs):
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        schedule_step(self.scheduler)
        return {"loss/pg": 0.0, "entropy": None, "loss": 0.0, "kl": None, "skipped_updates": 0.0, "grad_norm": 0.0,
                "zero_gradient": 1.0, "lr": self.scheduler.get_last_lr()[0]}

    def _forward(
        self, batch: Batch, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Policy log-probs, entropy, the value of each response position when there is a critic, and the
        logits when distillation or the loss's top-k divergence needs them (``PolicyPass``)."""
        distilling = bool(self.teachers) and self.algo.regularisers.distill_coef > 0
        return self.policy_pass(batch, entropy_grad, logits=distilling or self.anchor_topk > 0)

    def _topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``anchor_topk`` most likely tokens at each position and their log-probs, detached."""
        k = min(self.anchor_topk, logits.shape[-1])
        logp, ids = torch.log_softmax(logits.detach().float(), dim=-1).topk(k, dim=-1)
        return ids, logp

    def _teacher_logits(
        self, mb: Batch, logits: torch.Tensor | None, tasks: list[str]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each row's task teacher's logits on the same tokens under the same temperature (multi-teacher
        on-policy distillation), zeros on rows whose task has no teacher; and 1 per row that has one. Both
        None when not distilling."""
        if logits is None or not (self.teachers and self.algo.regularisers.distill_coef > 0):
            return None, None
        teacher_logits = torch.zeros_like(logits, requires_grad=False)
        has_teacher = torch.zeros(len(tasks), dtype=mb.loss_mask.dtype, device=logits.device)
        with torch.no_grad():
            for teacher in {id(m): m for m in self.teachers.values()}.values():
                rows = [i for i, t in enumerate(tasks) if self.teachers.get(t) is teacher]
                if not rows:
                    continue
                idx = torch.tensor(rows, device=logits.device)
                sub = Batch(*(getattr(mb, f)[idx] for f in mb.__dataclass_fields__))
                teacher_logits[idx] = response_logits(teacher, sub, self.temperature, self.bf16)
                has_teacher[idx] = 1.0
        return teacher_logits, has_teacher
