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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class TaskConfig(_Strict):
    name: str
    """A reasoning-gym dataset name (``polyrl tasks`` lists them)."""
    weight: float = Field(1.0, gt=0)
    params: dict[str, Any] = {}
    """Passed to the reasoning-gym dataset constructor (difficulty parameters)."""
    prompt_suffix: str = ""
    answer: Literal["last_number", "full"] = "last_number"
    """How the answer is read from a reply: the last number in it, or the whole stripped reply."""
    eval_size: int = Field(200, gt=0)


class RolloutConfig(_Strict):
    prompts_per_step: int = Field(2, gt=0)
    group_size: int = Field(8, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1.0)


class AlgorithmConfig(_Strict):
    advantage: str = "grpo"
    loss: str = "ppo_clip"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    track_kl: bool = True
    """Measure KL to the reference even when kl_coef is 0 (one extra no-grad forward per step)."""
    entropy_coef: float = 0.0
    epochs: int = Field(1, gt=0)
    """Optimisation passes over each rollout batch; 1 is strictly on-policy."""


class OptimConfig(_Strict):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    micro_batch_size: int = Field(16, gt=0)


class EvalConfig(_Strict):
    before: bool = True
    after: bool = True
    max_new_tokens: int | None = None
    """Defaults to rollout.max_new_tokens."""
    batch_size: int = Field(64, gt=0)


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
    progress: bool = True
    trajectories_per_group: int = Field(1, ge=0)
    """How many samples of each group to store in trajectories.jsonl per step (0 stores none)."""


class Config(_Strict):
    name: str = "run"
    model: ModelConfig = ModelConfig()
    tasks: list[TaskConfig] = Field(min_length=1)
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _check_names(self) -> Config:
        # Imported here: registries import torch-heavy modules that config users may not need.
        from polyrl.algorithms import ADVANTAGES, LOSSES
        from polyrl.envs.reasoning_gym import check_task_name

        for i, task in enumerate(self.tasks):
            check_task_name(task.name, key=f"tasks.{i}.name")
        ADVANTAGES.check(self.algorithm.advantage, key="algorithm.advantage")
        LOSSES.check(self.algorithm.loss, key="algorithm.loss")
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
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, dict | list):
                raise ConfigError(f"override '{key}': '{where}' is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override '{key}': '{last}' is not an index of the list")
        node[int(last)] = _parse_value(raw)
    else:
        node[last] = _parse_value(raw)


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
            data = yaml.safe_load(p.read_text()) or {}
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
