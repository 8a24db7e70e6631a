"""Typed experiment config: one YAML per experiment, validated up front, dotted overrides.

Every error is one line that names the offending key, so a typo never starts a 15-minute run. This package is
pure data: the names a config gives to registered envs, advantage estimators, losses and corrections are
checked against their registries by ``polyrl.config_check.load_config``, which parses with ``parse_config``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from polyrl.config.algorithm import (
    MOVED_ALGORITHM_KEYS,
    SHORTHANDS,
    AdvantageConfig,
    AlgorithmConfig,
    CriticConfig,
    GradientsConfig,
    LossConfig,
    OffPolicyConfig,
    RegularisersConfig,
    RewardGateConfig,
    SamplingConfig,
    ShapingConfig,
    merge_algorithm,
)
from polyrl.config.base import ConfigError, _Strict
from polyrl.config.features import (
    AgentsConfig,
    ArpoConfig,
    CurriculumConfig,
    EarlyStopConfig,
    GuidanceConfig,
    MonitorsConfig,
    PhaseConfig,
    PipelineConfig,
    ReplayConfig,
    RuntimeConfig,
    StageConfig,
    StepCreditConfig,
    check_curriculum,
)
from polyrl.config.sections import (
    CrossPolicyConfig,
    EngineConfig,
    EvalConfig,
    LearnerConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PromptSelectionConfig,
    RewardComponentConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    VllmConfig,
    component_names,
)

__all__ = [
    "MOVED_ALGORITHM_KEYS",
    "AdvantageConfig",
    "AgentsConfig",
    "AlgorithmConfig",
    "ArpoConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CrossPolicyConfig",
    "CurriculumConfig",
    "EarlyStopConfig",
    "EngineConfig",
    "EvalConfig",
    "GradientsConfig",
    "GuidanceConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "MonitorsConfig",
    "OffPolicyConfig",
    "OptimConfig",
    "PhaseConfig",
    "PipelineConfig",
    "PromptSelectionConfig",
    "RegularisersConfig",
    "ReplayConfig",
    "RewardComponentConfig",
    "RewardGateConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "SamplingConfig",
    "ShapingConfig",
    "StageConfig",
    "StepCreditConfig",
    "TaskConfig",
    "TrainConfig",
    "VllmConfig",
    "apply_override",
    "component_names",
    "dump_config",
    "merge_algorithm",
    "parse_config",
]


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
    learner: LearnerConfig = LearnerConfig()
    """Learner ranks and sharding (world_size 1: one process)."""
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    curriculum: CurriculumConfig | None = None
    """Task phases, difficulty levels and adaptive mixture ratios; unset is a fixed mixture."""
    stages: list[StageConfig] = []
    """An ordered pipeline (sft / rl / distill stages); empty is one RL run of ``train.steps``."""
    pipeline: PipelineConfig = PipelineConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    """Where rollouts and learning run: in one process, overlapped in two, or as Ray actors."""
    guidance: GuidanceConfig = GuidanceConfig()
    """Reference replies and hints for groups whose samples all fail (off unless ``guidance.reference`` or
    ``guidance.hint_fraction``)."""
    monitors: MonitorsConfig = MonitorsConfig()
    """Reward-hacking monitors: flags in metrics, report and viewer; optionally zero flagged rewards."""

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
            for key, section, overrides in (("algorithm", self.algorithm, stage.algorithm),
                                            ("rollout", self.rollout, stage.rollout)):
                base = section.model_dump()
                merged = (merge_algorithm(base, overrides, f"stages.{i}.algorithm") if key == "algorithm"
                          else {**base, **overrides})
                try:
                    type(section).model_validate(merged)
                except ValidationError as err:
                    first = err.errors()[0]
                    where = ".".join(str(p) for p in first["loc"])
                    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
                    msg = msg.removeprefix("Value error, ")
                    raise ValueError(f"stages.{i}.{key}{'.' + where if where else ''}: {msg}") from None
        distill = self.algorithm.regularisers.distill_coef
        if not self.stages and distill > 0 and not any(t.teacher for t in self.tasks):
            raise ValueError("algorithm.regularisers.distill_coef: > 0 but no tasks[].teacher is set")
        return self

    @model_validator(mode="after")
    def _check_sections(self) -> Config:
        for i, task in enumerate(self.tasks):
            if task.name in [t.name for t in self.tasks[:i]]:
                raise ValueError(f"tasks.{i}.name: task '{task.name}' is listed twice; names must differ")
        agents = [i for i, t in enumerate(self.tasks) if t.agent is not None]
        if agents and (self.runtime.kind != "local" or self.learner.world_size > 1):
            raise ValueError(f"tasks.{agents[0]}.agent: agent tasks run on one process's endpoint; they need "
                             "runtime.kind: local and learner.world_size: 1")
        if self.curriculum is not None:
            check_curriculum(self.curriculum, self.tasks)
            if self.runtime.kind != "local":  # its state lives where rollouts are drawn, not in checkpoints yet
                raise ValueError(f"curriculum: needs runtime.kind: local (got {self.runtime.kind})")
        algo, rollout = self.algorithm, self.rollout
        if algo.shaping.overlong_buffer > rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.shaping.overlong_buffer: {algo.shaping.overlong_buffer} is longer than "
                f"rollout.max_new_tokens ({rollout.max_new_tokens})"
            )
        arpo = self.agents.arpo
        if arpo.enabled and (rollout.group_size < 2 or (arpo.global_samples or 1) > rollout.group_size):
            raise ValueError(
                f"agents.arpo.global_samples: needs 1 <= global_samples <= rollout.group_size "
                f"({rollout.group_size}) and a group of at least 2"
            )
        if self.learner.world_size > 1 and self.runtime.kind == "async":
            raise ValueError("learner.world_size: the async runtime has one learner process; use runtime.kind "
                             "local (ranks on this machine) or ray (ranks on a cluster)")
        if self.learner.world_size > 1 and self.stages:
            raise ValueError("learner.world_size: a pipeline's stages hand each other HF checkpoints, which several "
                             "ranks do not write yet; run stages with learner.world_size: 1")
        rt, world = self.runtime, self.learner.world_size
        if rt.kind == "ray" and world == 1 and rt.engines == "colocated":
            raise ValueError("runtime.engines: colocated at learner.world_size 1 is the local runtime; use "
                             "runtime.kind: local, or engines: disaggregated for Ray workers")
        if world > 1 and rt.engines != "disaggregated" and (rt.num_workers > 1 or rt.eta > 0):
            raise ValueError("runtime.num_workers / runtime.eta: with learner.world_size > 1 and colocated engines "
                             "each rank rolls out its share of every step itself, in step with the update; leave "
                             "them at 1 and 0, or set runtime.engines: disaggregated")
        if world > 1 and rt.weight_sync == "object_store":
            raise ValueError("runtime.weight_sync: object_store puts a full copy of the policy on the driver; a "
                             "sharded learner (learner.world_size > 1) syncs through collective")
        if rt.weight_sync == "collective" and engines_of(self) != "disaggregated":
            raise ValueError("runtime.weight_sync: collective syncs disaggregated engines (runtime.kind: ray, "
                             "runtime.engines: disaggregated); colocated engines read the learner's weights")
        if self.guidance.hint_fraction > 0 and engines_of(self) == "disaggregated":  # they get task names only
            raise ValueError("guidance.hint_fraction: hinted prompts are rolled out where the step is drawn; "
                             "disaggregated Ray workers rebuild each task by name; use colocated engines")
        if self.engine.int8_weights:
            check_int8_engine(self)
        if algo.sampling.dynamic and rollout.group_size < 2:
            raise ValueError(
                "algorithm.sampling.dynamic: needs rollout.group_size >= 2 (a group of one never varies)"
            )
        return self

    @model_validator(mode="after")
    def _check_reward_gate(self) -> Config:
        """Reward components have distinct names and rules a valid pattern; the gate's outcome is one every
        task's trajectories record."""
        for i, task in enumerate(self.tasks):
            if task.attempts > 1 and task.max_turns is not None:
                raise ValueError(f"tasks.{i}.max_turns: tasks[].attempts sets the turns of a try-again episode; "
                                 "leave max_turns unset")
            for j, comp in enumerate(task.reward_components):
                key = f"tasks.{i}.reward_components.{j}.pattern"
                if (comp.kind == "rule") != (comp.pattern is not None):
                    raise ValueError(f"{key}: a rule component needs one, other kinds take none")
                if comp.pattern is not None:
                    try:
                        re.compile(comp.pattern)
                    except re.error as exc:
                        raise ValueError(f"{key}: not a regular expression ({exc})") from None
            names = component_names(task.reward_components)
            if len(set(names)) < len(names):
                raise ValueError(f"tasks.{i}.reward_components: two components named "
                                 f"'{next(n for n in names if names.count(n) > 1)}'; give each its own name")
        gate = self.algorithm.advantage.reward_gate
        if gate is None:
            return self
        shaping = ["overlong"] if self.algorithm.shaping.overlong_buffer > 0 else []
        for task in self.tasks:
            names = component_names(task.reward_components) if task.reward_components else [task.name]
            if gate.outcome not in names:
                raise ValueError(f"algorithm.advantage.reward_gate.outcome: task '{task.name}' has no reward "
                                 f"'{gate.outcome}'; its rewards: {', '.join(names + shaping)}")
        return self


def check_int8_engine(config: Config) -> None:
    """``engine.int8_weights`` runs on the HF engine's fused decode path with the native kernels, on the CPU."""
    engine = config.engine
    needs = (("engine.kind", engine.kind == "hf", "hf"), ("engine.fast_decode", engine.fast_decode, "true"),
             ("engine.native_kernels", engine.native_kernels, "true"),
             ("engine.bf16_weights", engine.bf16_weights is not True, "auto or false"),
             ("train.device", config.train.device != "cuda", "cpu or auto on a machine without a GPU"))
    for key, ok, wanted in needs:
        if not ok:
            raise ValueError(f"engine.int8_weights: samples through the fused decode path's native int8 kernels "
                             f"on the CPU; it needs {key}: {wanted}")


def engines_of(config: Config) -> str:
    """``runtime.engines`` resolved: disaggregated for Ray at world size 1 under auto, else colocated."""
    rt = config.runtime
    if rt.engines != "auto":
        return rt.engines
    return "disaggregated" if rt.kind == "ray" and config.learner.world_size == 1 else "colocated"


def weight_sync_of(config: Config) -> str:
    """``runtime.weight_sync`` resolved: object_store at world size 1 under auto, else collective."""
    if config.runtime.weight_sync != "auto":
        return config.runtime.weight_sync
    return "object_store" if config.learner.world_size == 1 else "collective"


def _parse_value(text: str) -> Any:
    """Command-line values are YAML scalars: ``3`` is an int, ``true`` a bool, ``[a, b]`` a list."""
    return yaml.safe_load(text) if text != "" else ""


def _shorthand(parts: list[str], depth: int) -> str | None:
    """The key a bare name stands for when ``parts[depth]`` is a sub-section of ``algorithm`` that takes one
    (``algorithm.loss: gspo`` is ``algorithm.loss.name: gspo``; also in ``stages.N.algorithm``), else None."""
    return SHORTHANDS.get(parts[depth]) if depth > 0 and parts[depth - 1] == "algorithm" else None


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; list items are addressed by index (``tasks.0.name=x``).

    An algorithm sub-section written as a bare name (``loss: gspo``) is written out when a key below it is set
    (``algorithm.loss.clip_high=0.28``), and a bare name set over a written-out one (``algorithm.loss=cispo``)
    changes only its name."""
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
            if isinstance(node.get(part), str) and (name := _shorthand(parts, depth)):
                node[part] = {name: node[part]}
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
    elif isinstance(value, str) and isinstance(node.get(last), dict) and (name := _shorthand(parts, len(parts) - 1)):
        node[last] = {**node[last], name: value}
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


def parse_config(path: str | Path | None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Load a YAML file (or a dict), apply dotted overrides, validate the structure and values; raise ConfigError
    on any problem. Registered names are not looked up here: ``polyrl.config_check.load_config`` does both."""
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
