"""The ``algorithm`` section, grouped by what each key belongs to: the advantage, the policy loss, the off-policy
correction, the regularisers, the critic, DAPO's sampling and shaping, and per-task gradients
(docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from polyrl.config.base import _Strict


class RewardGateConfig(_Strict):
    """Gated shaping (``algorithm.advantage.reward_gate``): shaping pays only when the outcome passes a
    threshold."""

    outcome: str
    """The outcome reward component, a key of the trajectories' rewards: ``env`` (or ``judge``) with
    tasks[].reward_components, else the task's name."""
    threshold: float = 1.0
    """Below this outcome, the gated components' positive parts are withheld."""
    gated: list[str] = []
    """The components gated; empty: every component but ``outcome`` (e.g. ``overlong``, a judge's score)."""


class AdvantageConfig(_Strict):
    """How each sample's advantage is made from its rewards (``advantage: grpo`` is short for
    ``advantage: {estimator: grpo}``)."""

    estimator: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, maxrl (group mean as the
    scale), gdpo (each reward component normalised in its group, then summed), pass_at_k (the analytical
    pass@k advantage; ``kwargs: {k: 4}``), or one registered with ``@ADVANTAGES.register``. Not used with a
    ``critic``, whose values give the advantages (GAE)."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the estimator, e.g. ``{eps: 1.0e-6}`` for grpo; pass_at_k needs ``k`` (1 to
    rollout.group_size) and takes ``success_score`` (1.0: a reward at or above it is a success)."""
    task_norm: bool = False
    """AgentRL task-advantage normalisation: after the estimator, normalise advantages to mean 0 and std 1
    within each task of the batch, so tasks with larger reward spreads do not dominate the update."""
    reward_gate: RewardGateConfig | None = None
    """Gated shaping, e.g. ``{outcome: env, threshold: 1.0, gated: [judge]}``: a trajectory whose ``outcome``
    component is below the threshold keeps only the negative part of each gated component; null is off."""


class LossConfig(_Strict):
    """The policy loss and how it is applied (``loss: ppo_clip`` is short for ``loss: {name: ppo_clip}``)."""

    name: str = "ppo_clip"
    """Policy loss: ppo_clip, dual_clip, gspo, cispo, dppo (divergence trust region; clip_low/clip_high are its
    size), sapo (soft gate), or one registered with ``@LOSSES.register``."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the loss, e.g. ``{c: 3.0}`` for dual_clip."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range: the ratio is clipped at 1 - clip_low (gspo: about 3e-4)."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip range: 1 + clip_high; DAPO's clip-higher raises it (0.28) to keep exploration."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one number: token-mean (DAPO), seq-mean-token-mean (GRPO, GSPO),
    seq-mean-token-sum (Dr.GRPO)."""
    pg_coef: float = Field(1.0, ge=0)
    """Weight of the policy-gradient loss; distill stages set it to 0 (pure on-policy distillation)."""
    epochs: int = Field(1, gt=0)
    """Optimisation passes over each rollout batch; 1 is strictly on-policy."""
    mask_truncated: bool = False
    """Leave samples cut off at max_new_tokens out of the loss (DAPO overlong filtering)."""


class OffPolicyConfig(_Strict):
    """Correction for tokens sampled by an older policy or another engine (``off_policy: tis`` is short for
    ``off_policy: {correction: tis}``; docs/systems.md)."""

    correction: Literal["none", "decoupled", "tis", "m2po", "mis", "icepop", "geo_mask", "prob_mask"] = "none"
    """Correction for tokens sampled by an older policy (async runtimes, partial rollouts; docs/systems.md).
    none: the ratio is to the policy at the update's start and the behaviour log-probs go unused. decoupled:
    AReaL's decoupled PPO, ratio to the proximal policy (the learner's weights at the update's start,
    log-probs recomputed) times the weight pi_prox / pi_behaviour. tis: the same weight truncated at
    ``tis_cap`` (Yao et al. 2025). m2po: ratio to the behaviour policy, tokens masked by M2PO's second-moment
    bound ``m2po_tau`` (Zheng et al. 2025). The engine/learner mismatch corrections, ratio to the proximal
    policy, settings in ``kwargs``: mis: sequence-level truncated IS, min(pi_prox(y) / mu(y), cap) per
    sequence ({cap: 2.0, drop: false}; drop masks the sequence instead). icepop: token weight r_t inside
    [alpha, beta], 0 outside ({alpha: 0.5, beta: 5.0}). geo_mask: sequences whose geometric-mean ratio leaves
    [low, high] masked ({low: 0.99, high: 1.01}). prob_mask: tokens with |pi_prox(y_t) - mu(y_t)| > eps
    masked ({eps: 0.2})."""
    kwargs: dict[str, Any] = {}
    """Settings of the mis, icepop, geo_mask and prob_mask corrections (see correction)."""
    tis_cap: float = Field(2.0, gt=0)
    """Truncation C of the importance weight min(pi_prox / pi_behaviour, C) (correction: tis)."""
    m2po_tau: float = Field(0.04, ge=0)
    """M2PO's bound on the mean squared log importance ratio of the kept tokens (correction: m2po)."""
    mismatch_band: float = Field(0.2, gt=0)
    """Band of the always-logged ``mismatch/beyond_band_frac``: the fraction of tokens whose ratio between
    the learner's and the engine's probability leaves [1 - band, 1 + band]."""


class RegularisersConfig(_Strict):
    """Terms beside the policy loss: KL to the initial policy, the entropy bonus, distillation to teachers, SFT on
    successes."""

    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the initial policy; 0 is no penalty."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: a loss term, or -kl_coef * KL per token in the reward (then advantages are
    per token)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020): k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2, k3 = ratio - 1 - log ratio."""
    track_kl: bool = True
    """Measure KL to the reference even when kl_coef is 0 (one extra no-grad forward per step)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (positive rewards higher entropy); with ``entropy_target``, its starting value."""
    entropy_target: float | None = Field(None, ge=0)
    """Hold the policy's entropy at this many nats per token (Skywork-OR1's adaptive entropy control): after
    each step the entropy coefficient moves up by ``entropy_coef_step`` when the step's token-mean entropy was
    below it, down (not below 0) when above; null keeps ``entropy_coef`` fixed."""
    entropy_coef_step: float = Field(0.005, gt=0)
    """With ``entropy_target``, how far the entropy coefficient moves after each step."""
    entropy_coef_max: float = Field(0.05, ge=0)
    """With ``entropy_target``, the highest the entropy coefficient goes (a policy whose entropy cannot be
    raised must not get an ever larger bonus)."""
    distill_coef: float = Field(0.0, ge=0)
    """Weight of the per-token reverse KL to each task's teacher (tasks[].teacher, docs/multidomain.md);
    0 is off."""
    sft_coef: float = Field(0.0, ge=0)
    """Weight of a supervised term on the batch's successes, interleaved with RL (RAFT, SRFT): the negative
    log-likelihood of the tokens of every row whose reward reaches ``sft_min_reward`` (the policy's own
    successes, replayed ones and guidance's references), aggregated as the policy loss is; 0 is off."""
    sft_min_reward: float = 1.0
    """With ``sft_coef``, the reward at or above which a row is a success."""

    @model_validator(mode="after")
    def _check_entropy_control(self) -> RegularisersConfig:
        if self.entropy_target is not None and not 0 <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(f"algorithm.regularisers.entropy_coef: with entropy_target it is the starting "
                             f"coefficient, between 0 and entropy_coef_max ({self.entropy_coef_max}); got "
                             f"{self.entropy_coef}")
        return self


class CriticConfig(_Strict):
    """PPO's critic (``algorithm.critic``): a value head on the policy's final hidden states, and advantages by
    GAE (Schulman et al. 2016) from its values instead of a sample-level estimator."""

    gamma: float = Field(1.0, ge=0, le=1)
    """GAE's discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda: 1 is Monte-Carlo returns minus the value, 0 is one-step TD."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the value head; it learns from scratch, so faster than the policy."""
    clip: float | None = Field(0.2, gt=0)
    """PPO value clipping range; null is the plain squared error."""
    width: int = Field(128, gt=0)
    """Hidden width of the value head's MLP."""


class SamplingConfig(_Strict):
    """DAPO's dynamic sampling."""

    dynamic: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts to refill."""
    max_extra_rounds: int = Field(3, ge=0)
    """With ``dynamic``, at most this many extra rollout rounds per step."""


class ShapingConfig(_Strict):
    """DAPO's soft overlong penalty, added to each reward as its ``overlong`` component."""

    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong penalty over the last this-many tokens before rollout.max_new_tokens; 0 is off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Scale of the overlong penalty (it ramps from 0 to -overlong_penalty)."""


class GradientsConfig(_Strict):
    """Per-task gradients of a multi-task batch: surgery on their conflicts, and their logged norms."""

    surgery: Literal["none", "pcgrad"] = "none"
    """pcgrad: each task's gradient is projected off the other tasks' gradients it conflicts with (Yu et al.
    2020), at the cost of one forward and backward pass per task of the batch. The task_grad/ metrics are then
    logged every step."""
    task_grad_every: int = Field(0, ge=0)
    """Every this many steps, log each task's gradient norm (task_grad/norm/<task>) and the cosine between
    every two tasks' gradients (task_grad/cos/<a>/<b>), from one pass per task; 0 is off."""


SHORTHANDS = {"advantage": "estimator", "loss": "name", "off_policy": "correction"}
"""Sub-sections of ``algorithm`` that a bare name stands for: ``loss: gspo`` is ``loss: {name: gspo}``."""

MOVED_ALGORITHM_KEYS = {
    "gamma": "critic.gamma", "lam": "critic.lam", "value_lr": "critic.lr", "value_clip": "critic.clip",
    "value_width": "critic.width",
    "advantage_kwargs": "advantage.kwargs", "task_norm": "advantage.task_norm",
    "reward_gate": "advantage.reward_gate",
    "loss_kwargs": "loss.kwargs", "clip_low": "loss.clip_low", "clip_high": "loss.clip_high", "loss_agg": "loss.agg",
    "pg_coef": "loss.pg_coef", "epochs": "loss.epochs", "mask_truncated": "loss.mask_truncated",
    "off_policy_kwargs": "off_policy.kwargs", "tis_cap": "off_policy.tis_cap", "m2po_tau": "off_policy.m2po_tau",
    "mismatch_band": "off_policy.mismatch_band",
    "kl_coef": "regularisers.kl_coef", "kl_in": "regularisers.kl_in", "kl_estimator": "regularisers.kl_estimator",
    "track_kl": "regularisers.track_kl", "entropy_coef": "regularisers.entropy_coef",
    "distill_coef": "regularisers.distill_coef",
    "dynamic_sampling": "sampling.dynamic", "max_extra_rounds": "sampling.max_extra_rounds",
    "overlong_buffer": "shaping.overlong_buffer", "overlong_penalty": "shaping.overlong_penalty",
    "gradient_surgery": "gradients.surgery", "task_grad_every": "gradients.task_grad_every",
}
"""Keys that left ``algorithm``'s top level, and where each lives now (under ``algorithm``)."""


def refuse_moved_keys(data: dict[str, Any], where: str = "algorithm") -> None:
    """A one-line ValueError for the first key of ``data`` (an ``algorithm`` mapping, at ``where``) that moved."""
    for key in data:
        if key in MOVED_ALGORITHM_KEYS:
            raise ValueError(f"{where}.{key}: moved to {where}.{MOVED_ALGORITHM_KEYS[key]}")


def expand_shorthands(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (an ``algorithm`` mapping) with each bare name of a sub-section written out in full."""
    short = {k: {v: data[k]} for k, v in SHORTHANDS.items() if isinstance(data.get(k), str)}
    return {**data, **short} if short else data


def merge_algorithm(base: dict[str, Any], overrides: dict[str, Any], where: str = "algorithm") -> dict[str, Any]:
    """``base`` (a dumped ``algorithm``) with a stage's ``overrides`` applied: a sub-section given as a mapping
    (or a bare name) changes only the keys it names; any other value replaces the base's. Moved keys are
    refused naming their new place under ``where``."""
    refuse_moved_keys(overrides, where)
    out = dict(base)
    for key, value in expand_shorthands(overrides).items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class AlgorithmConfig(_Strict):
    """The objective (docs/algorithms.md): the advantage, the policy loss, the off-policy correction, the
    regularisers, the critic, DAPO's sampling and shaping, and per-task gradients."""

    advantage: AdvantageConfig = AdvantageConfig()
    """The advantage estimator and what is done to its output; ``advantage: rloo`` names just the estimator."""
    loss: LossConfig = LossConfig()
    """The policy loss, its clipping, aggregation and passes; ``loss: gspo`` names just the loss."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """The off-policy correction; ``off_policy: tis`` names just the correction."""
    regularisers: RegularisersConfig = RegularisersConfig()
    """KL to the initial policy, entropy bonus, distillation to teachers."""
    critic: CriticConfig | None = None
    """PPO with a critic: present (``critic: {}`` for its defaults) means GAE advantages from a value head."""
    sampling: SamplingConfig = SamplingConfig()
    """DAPO's dynamic sampling."""
    shaping: ShapingConfig = ShapingConfig()
    """DAPO's soft overlong penalty."""
    gradients: GradientsConfig = GradientsConfig()
    """Per-task gradient surgery and gradient metrics."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        refuse_moved_keys(data)
        advantage = expand_shorthands(data).get("advantage")
        if isinstance(advantage, dict) and advantage.get("estimator") == "gae":
            raise ValueError("algorithm.advantage: gae is declared as a critic now: algorithm.critic: {} (or "
                             "{gamma: 1.0, lam: 0.95, lr: 1.0e-3, clip: 0.2, width: 128}); its presence means GAE")
        return data

    @field_validator(*SHORTHANDS, mode="before")
    @classmethod
    def _shorthand(cls, value: Any, info: ValidationInfo) -> Any:
        return {SHORTHANDS[info.field_name]: value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_critic(self) -> AlgorithmConfig:
        if self.critic is None:
            return self
        if self.advantage.task_norm:
            raise ValueError("algorithm.advantage.task_norm: needs a sample-level estimator; with a critic the "
                             "advantages come from its values per token")
        if self.advantage.estimator != AdvantageConfig.model_fields["estimator"].default:  # a dump holds the default
            raise ValueError(f"algorithm.advantage: '{self.advantage.estimator}' is a sample-level estimator, and "
                             "algorithm.critic makes the advantages from its values: keep one of the two")
        return self
