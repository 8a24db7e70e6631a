"""Optional feature sections: agent training, curricula, pipeline stages, runtimes (all off by default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl.config.base import _Strict
from polyrl.config.sections import TaskConfig


class ArpoConfig(_Strict):
    """ARPO entropy-guided branching (Dong et al. 2025); docs/agents.md."""

    enabled: bool = False
    global_samples: int | None = Field(None, gt=0)
    """Full rollouts per group (M); the other group_size - M leaves are branches. Unset: half the group."""
    entropy_tokens: int = Field(10, gt=0)
    """k: entropy is the mean over the first k tokens of a turn (turn 1 gives the initial entropy)."""
    entropy_threshold: float = 0.0
    """Branch after a tool result when its entropy exceeds the initial entropy by more than this (nats)."""
    branch_width: int = Field(2, gt=0)
    """Partial rollouts started at one branch point (Z), budget permitting."""


class ReplayConfig(_Strict):
    """Success replay and prompt replay (ARPO for GUI agents, Lu et al. 2025; RLEP); docs/agents.md."""

    success_buffer: int = Field(0, ge=0)
    """Successful trajectories kept per item; a group whose samples all failed gets one mixed in. 0 is off."""
    replay_ratio: float = Field(1.0, ge=0, le=1)
    """Probability that an all-fail group with a stored success gets one."""
    success_score: float = 1.0
    """A trajectory counts as a success when its score (info.score) reaches this."""
    is_cap: float = Field(1.0, gt=0)
    """Truncation c of a replayed token's importance weight min(pi_old / mu, c)."""
    prompt_replay: float = Field(0.0, ge=0, le=1)
    """Fraction of each step's prompts re-drawn from items already seen, favouring pass rates near 0.5."""


class GuidanceConfig(_Strict):
    """Off-policy guidance for groups whose samples all fail (docs/guidance.md): such a group teaches a group
    baseline nothing, so the item's reference reply (``tasks[].reference``) takes its last sample's place, as
    LUFFY mixes reference solutions into its groups (Yan et al. 2025, "Learning to Reason under Off-Policy
    Guidance"), only in all-fail groups as AMPO does, the help optionally annealed away as HAPO's is. Hints
    (``hint_fraction``) sample such a group's item again with the start of that reply in its prompt, as GHPO
    and QuestA do (Liu et al. 2025; Li et al. 2025)."""

    reference: bool = False
    """Mix the reference reply into all-fail groups."""
    probability: float = Field(1.0, ge=0, le=1)
    """Probability that an all-fail group gets it."""
    anneal_steps: int = Field(0, ge=0)
    """The probability falls linearly to 0 over this many steps (0: it stays)."""
    shaping_gamma: float | None = Field(None, gt=0)
    """null: the reference's tokens are weighed as if the policy had sampled them (gradient A grad log p).
    A number: LUFFY's policy shaping f(p) = p / (p + gamma) (the paper uses 0.1), whose push peaks on tokens
    of probability near gamma and fades for tokens the policy finds far less likely (docs/guidance.md)."""
    success_score: float = 1.0
    """A sample succeeds when its score (info.score) reaches this; a group without one is all-fail."""
    hint_fraction: float = Field(0.0, ge=0, lt=1)
    """Hints: an all-fail group's item is sampled again as a new group, its prompt given this share of the
    reference reply's characters (a reply of several words cut back to a whole word); 0 is off."""
    hint_anneal_steps: int = Field(0, ge=0)
    """The hint fraction falls linearly to 0 over this many steps (0: it stays)."""
    hint_template: str = "\n\nHint: a correct reply begins with: {hint}"
    """Appended to the last user message of a hinted prompt; ``{hint}`` is the revealed start of the reply."""

    @field_validator("hint_template")
    @classmethod
    def _check_hint_template(cls, template: str) -> str:
        try:
            filled = template.format(hint="\0")
        except (KeyError, IndexError, ValueError) as exc:  # another field, or a stray brace
            raise ValueError(f"guidance.hint_template: not a template whose one field is {{hint}} "
                             f"({type(exc).__name__}: {exc}); write a literal brace as {{{{ or }}}}") from None
        if filled.count("\0") != 1:
            raise ValueError("guidance.hint_template: must contain the {hint} field exactly once")
        return template


class StepCreditConfig(_Strict):
    """Per-turn advantages for multi-turn episodes; docs/agents.md."""

    mode: Literal["off", "gigpo", "turn_discount"] = "off"
    """gigpo: step groups of identical env states (Feng et al. 2025); turn_discount: discounted turn returns."""
    weight: float = Field(1.0, ge=0)
    """gigpo: weight of the step advantage added to the episode advantage."""
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount over turns for the returns of both modes."""


class EarlyStopConfig(_Strict):
    """Stop a rollout when its smoothed uncertainty spikes above its own running baseline; docs/agents.md."""

    enabled: bool = False
    signal: Literal["surprise", "entropy"] = "surprise"
    """surprise: -log-prob of the sampled token; entropy: of the sampling distribution."""
    alpha: float = Field(0.3, gt=0, le=1)
    """Smoothing of the signal's exponential moving average."""
    threshold: float = Field(2.0, gt=0)
    """Stop when the average exceeds the rollout's running mean by this much (nats)."""
    min_tokens: int = Field(8, ge=0)
    """Never stop a rollout before it has produced this many tokens."""
    terminal_reward: float = 0.0
    """The reward of a rollout stopped early (it replaces the env's)."""


class AgentsConfig(_Strict):
    """Agent training features, all off by default (docs/agents.md)."""

    arpo: ArpoConfig = ArpoConfig()
    replay: ReplayConfig = ReplayConfig()
    step_credit: StepCreditConfig = StepCreditConfig()
    early_stop: EarlyStopConfig = EarlyStopConfig()


class PhaseConfig(_Strict):
    """One phase of a declared task order."""

    until_step: int = Field(gt=0)
    """The phase lasts through this step (the last phase also runs on past it)."""
    weights: dict[str, float]
    """Task name -> mixture weight during the phase; tasks left out are not drawn."""


class CurriculumConfig(_Strict):
    """Task order, rising difficulty and an adaptive mixture (docs/multidomain.md); all off by default."""

    phases: list[PhaseConfig] = []
    """A declared task order: the mixture weights by phase; empty uses ``tasks[].weight`` throughout."""
    levels: dict[str, list[dict[str, Any]]] = {}
    """Task name -> difficulty levels, each a dict of params merged over ``tasks[].params`` (level 0 is the
    task's own params); a task moves up a level when its recent pass rate exceeds ``promote_at``."""
    promote_at: float = Field(0.8, gt=0, le=1)
    """Pass rate (fraction of recent samples fully solved) that moves a task to its next level."""
    pass_window: int = Field(64, gt=0)
    """Recent samples per task over which the pass rate is measured (it must be full to promote)."""
    adaptive: bool = False
    """Adapt the mixture online to each task's learning progress, the absolute slope of its recent mean reward
    (Matiisen et al. 2017, teacher-student curriculum); replaces phases and weights once every task has
    history."""
    progress_window: int = Field(8, ge=2)
    """Recent steps of each task's mean reward that the slope is fitted over."""
    floor: float = Field(0.1, ge=0, le=1)
    """Share of the adaptive mixture spread evenly over the tasks, so none starves."""


def check_curriculum(cfg: CurriculumConfig, tasks: Sequence[TaskConfig]) -> None:
    """Config-time checks; a one-line ValueError naming the key."""
    names = [t.name for t in tasks]
    last = 0
    for i, phase in enumerate(cfg.phases):
        key = f"curriculum.phases.{i}"
        if phase.until_step <= last:
            raise ValueError(f"{key}.until_step: {phase.until_step} must be after the previous phase's ({last})")
        last = phase.until_step
        for name, w in phase.weights.items():
            if name not in names:
                raise ValueError(f"{key}.weights.{name}: no task named '{name}'; tasks: {', '.join(names)}")
            if w < 0:
                raise ValueError(f"{key}.weights.{name}: weight {w} is negative")
        if sum(phase.weights.values()) <= 0:
            raise ValueError(f"{key}.weights: at least one task needs a positive weight")
    for name, levels in cfg.levels.items():
        if name not in names:
            raise ValueError(f"curriculum.levels.{name}: no task named '{name}'; tasks: {', '.join(names)}")
        if not levels:
            raise ValueError(f"curriculum.levels.{name}: list at least one level above the task's own params")


class StageConfig(_Strict):
    """One stage of a pipeline (docs/multidomain.md): unset fields inherit the top-level config."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Names the stage's directory, RUN_DIR/stages/<i>-<name>."""
    kind: Literal["sft", "rl", "distill"] = "rl"
    """sft: supervised on gold answers; rl: the RL loop; distill: on-policy distillation from teachers."""
    tasks: list[str] = []
    """Names from the top-level ``tasks`` this stage trains on; empty is all of them."""
    steps: int = Field(ge=0)
    lr: float | None = Field(None, gt=0)
    """Overrides optim.lr."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Overrides rollout.max_new_tokens."""
    algorithm: dict[str, Any] = {}
    """Overrides of ``algorithm`` keys for this stage, e.g. ``{advantage: rloo, regularisers: {kl_coef: 0.01}}``:
    a sub-section changes only the keys it names (``loss: gspo`` only the loss's name)."""
    rollout: dict[str, Any] = {}
    """Overrides of ``rollout`` keys for this stage, e.g. ``{prompts_per_step: 8, group_size: 2}``: a distill
    stage needs no groups to compare rewards in, so more distinct prompts for the same samples."""
    teachers: dict[str, str] = {}
    """Task name -> teacher: ``best`` (the registry's best checkpoint for that task so far) or a model. A
    distill stage defaults every task without a tasks[].teacher to ``best``."""
    replay: float = Field(0.0, ge=0, lt=1)
    """rl stages: share of each step's prompts drawn from the pipeline's other tasks (split evenly over them,
    see ``replay_from``), so a domain is learnt while the others are still practised."""
    replay_from: Literal["earlier", "all"] = "earlier"
    """rl stages with ``replay``: ``earlier`` replays the tasks that earlier stages trained; ``all`` every other
    task of the pipeline, so domains not trained yet are also held (by ``retain_coef``'s KL to their best
    checkpoint so far, at first the base model) instead of drifting before their own stage."""
    retain_coef: float = Field(0.0, ge=0)
    """rl stages with ``replay``: weight of the reverse KL to each replayed task's best checkpoint on its
    prompts (on-policy distillation interleaved with RL); the stage's own tasks have no teacher."""
    sft_from: Literal["gold", "teacher"] = "gold"
    """sft stages: train on the items' gold answers (or the env's demonstrations), or on each task's teacher's
    replies (``teachers``, tasks[].teacher, else the registry's best checkpoint) that its reward scores
    correct, ``rollout.group_size`` samples per drawn item (rejection-sampled distillation; a task whose best
    is the stage's start is trained on its own correct replies, which holds it where it is)."""
    until_within: float | None = Field(None, ge=0)
    """distill stages (and sft stages with ``sft_from: teacher``): stop early once every task's validation
    accuracy is within this (a fraction) of its teacher's, checked every ``eval_every`` steps; ``steps`` is
    then the budget. Validation items are disjoint from the held-out ones the pipeline reports
    (pipeline.validation_size per task)."""
    keep_best: bool = False
    """rl stages: validate every task of the pipeline every ``eval_every`` steps and end the stage at the part
    (the start included) with the highest mean validation accuracy, not necessarily its last step."""
    eval_every: int = Field(5, gt=0)
    """Steps between the validation checks of ``until_within`` and ``keep_best``."""
    focus: float = Field(0.0, ge=0)
    """stages with ``until_within``: after each validation check, each task's sampling weight becomes
    its configured weight times 1 + ``focus`` x its shortfall to its teacher in points, so the domains
    furthest behind get more of the next part's prompts (0: the configured weights throughout)."""

    @property
    def taught(self) -> bool:
        """Whether the stage learns from teachers: a distill stage, or an sft stage with ``sft_from: teacher``."""
        return self.kind == "distill" or self.sft_from == "teacher"

    @model_validator(mode="after")
    def _check_kind(self) -> StageConfig:
        if self.kind != "rl" and (self.replay or self.retain_coef):
            raise ValueError(f"stage '{self.name}': replay and retain_coef apply to rl stages, not {self.kind}")
        if self.retain_coef and not self.replay:
            raise ValueError(f"stage '{self.name}': retain_coef needs replay > 0 (the replayed prompts)")
        if self.replay_from != "earlier" and not self.replay:
            raise ValueError(f"stage '{self.name}': replay_from needs replay > 0 (the replayed prompts)")
        if self.sft_from != "gold" and self.kind != "sft":
            raise ValueError(f"stage '{self.name}': sft_from applies to sft stages, not {self.kind}")
        if not self.taught and self.until_within is not None:
            raise ValueError(f"stage '{self.name}': until_within applies to distill stages and sft stages with "
                             f"sft_from: teacher (it compares with the teachers), not this {self.kind} stage")
        if self.keep_best and self.kind != "rl":
            raise ValueError(f"stage '{self.name}': keep_best applies to rl stages, not {self.kind}")
        if self.focus and self.until_within is None:
            raise ValueError(f"stage '{self.name}': focus needs until_within (its validation checks)")
        return self


class PipelineConfig(_Strict):
    """What happens after each stage of ``stages``: held-out eval of every task, registry, regressions."""

    regression_threshold: float = Field(0.02, ge=0)
    """A task whose held-out accuracy falls more than this (a fraction: 0.02 is 2 points) below its best
    earlier stage is reported as regressed."""
    on_regression: Literal["report", "distill"] = "report"
    """distill: insert a distill stage after the regressing one, teaching each regressed task from its best
    checkpoint in the registry."""
    regression_steps: int = Field(20, gt=0)
    """Steps of an inserted distill stage."""
    validation_size: int = Field(50, gt=0)
    """Validation items per task for the early stopping of distill stages (stages[].until_within)."""


class RuntimeConfig(_Strict):
    """Runtimes (docs/systems.md): all run the same two halves of a step, produce a batch and learn from it."""

    kind: Literal["local", "async", "ray"] = "local"
    """local: one process, rollout then update. async: a rollout process produces batches while the learner
    updates (torch.multiprocessing). ray: rollout workers as Ray actors, the learner in the driver process
    (``polyrl[ray]``)."""
    eta: int = Field(0, ge=0)
    """Staleness bound: every token trained on at learner version v was sampled by a policy of version
    >= v - eta. 0 reproduces the local run exactly (async) or waits for every update (ray)."""
    num_workers: int = Field(1, gt=0)
    """Rollout workers (ray: actors that share each step's groups; async: must be 1, one rollout process)."""
    engines: Literal["auto", "colocated", "disaggregated"] = "auto"
    """Where rollouts run. colocated: in the learner's own processes, on its devices (local and async; under
    ray with ``learner.world_size`` > 1, each rank rolls out its share). disaggregated: on ``num_workers`` Ray
    actors with their own CPUs (a GPU each on cuda), synced after every update (ray only). auto: disaggregated
    for ray at world size 1, colocated otherwise."""
    weight_sync: Literal["auto", "object_store", "collective"] = "auto"
    """How disaggregated workers get each update's weights. object_store: the driver puts one full state dict
    into Ray's object store (small models, world size 1). collective: learner rank 0 and the workers form a
    torch.distributed group (gloo on CPU, NCCL on GPU) and the weights travel in buckets, gathered from the
    shards without a full copy (parallel/weight_sync.py; LoRA sends the adapters only). auto: object_store at
    world size 1, collective above."""
    sync_bucket_mb: float = Field(256.0, gt=0)
    """collective weight sync: the most MB (10**6 bytes) of weights in one broadcast."""
    partial_rollouts: bool = False
    """async: generate in chunks of ``chunk_tokens`` and load new weights between chunks, so a response
    started by one policy version is continued by the next (each token keeps its own version and log-prob)."""
    chunk_tokens: int = Field(16, gt=0)
    """Tokens generated between weight checks with ``partial_rollouts``."""
    rollout_threads: int | None = Field(None, gt=0)
    """async: torch threads of the rollout process; unset uses the learner's count."""
    ray_address: str | None = None
    """ray: an existing cluster's address (``ray start --head`` prints it); unset starts a local Ray."""
    ray_num_cpus: int | None = Field(None, gt=0)
    """ray: CPUs of the local Ray started when ``ray_address`` is unset (default: all)."""
    keep_freed_memory: bool = True
    """Linux/glibc: freed large blocks stay in the process for reuse instead of being unmapped and page-faulted
    in again next step (``train/glibc_malloc.py``): a 16-row update with 64-token answers about 25 % faster, peak
    memory up to a few hundred MB higher."""
    memory_budget_gb: float | None = Field(None, gt=0)
    """Linux/glibc: resident memory (GB) above which the heap's free pages go back to the OS (``malloc_trim``)
    before each update (held-out evaluation always starts with them given back), so keeping freed memory takes
    no more than the run is given. Unset: 80 % of the memory available when the run starts (MemAvailable,
    capped by a container's cgroup limit)."""

    @model_validator(mode="after")
    def _check_runtime(self) -> RuntimeConfig:
        if self.kind == "async" and self.num_workers != 1:
            raise ValueError("runtime.num_workers: the async runtime has one rollout process; use kind: ray "
                             "for more workers")
        if self.partial_rollouts and self.kind != "async":
            raise ValueError("runtime.partial_rollouts: needs runtime.kind: async")
        if self.engines == "disaggregated" and self.kind != "ray":
            raise ValueError("runtime.engines: disaggregated engines are Ray actors; needs runtime.kind: ray")
        return self


class MonitorsConfig(_Strict):
    """Reward-hacking monitors (``polyrl/rewards/monitors.py``): static checks of each sample of a code task
    (HumanEval) or a last-number task, logged per step as the share of rewarded samples flagged."""

    enabled: bool = True
    """Flag samples and log ``monitor/*`` metrics (static analysis only; the samples never run for it)."""
    zero_flagged: bool = False
    """Zero the reward of a flagged sample before advantages are computed (``monitor/zeroed`` counts them)."""
    many_numbers: int = Field(8, ge=2)
    """A last-number reply with at least this many numbers, half of them from the prompt, is flagged."""
