"""Loading a run's config: parse it (``polyrl.config``, pure data), then check the names it gives against the
registries of envs, advantage estimators, policy losses and off-policy corrections.

The check sits here, above both the config and the registries, so that the config never imports what it
configures. Every error is still one line that names the file and key.
"""

from __future__ import annotations

import importlib
import json
from importlib.util import find_spec
from pathlib import Path

from polyrl.algorithms.validate import check_algorithm
from polyrl.config import AlgorithmConfig, Config, ConfigError, merge_algorithm, parse_config
from polyrl.envs.base import check_task


def check_extras(config: Config) -> None:
    """The optional packages the config asks for are installed (found without importing them), so a missing
    one fails here, with its install command, not after the model has loaded. MLflow and W&B are checked with
    the logging section (``config/sections.py``), TextArena and verifiers with their tasks' names (``envs/``),
    the Agents SDK where an agent's module uses the adapter (``check_agent_sdk``).

    vLLM is not checked here: configs of vLLM runs are also loaded where they are planned, on machines without
    vLLM (``benchmarks/gpu_check.py`` plans GPU and CPU runs alike); ``polyrl train`` checks it before the
    model loads (``check_machine``), and ``make_engine`` for runs started from Python."""
    if config.runtime.kind == "ray" and find_spec("ray") is None:
        raise ValueError("runtime.kind: ray is not installed; pip install 'polyrl[ray]'")


def check_agent_sdk(config: Config) -> None:
    """An agent task whose module runs OpenAI Agents SDK agents (it imports ``polyrl.adapters.agents_sdk``)
    needs the SDK: without it every episode would be dropped at its first call, and the run train on nothing."""
    if find_spec("agents") is not None:
        return
    for i, task in enumerate(config.tasks):
        if task.agent is None:
            continue
        module = importlib.import_module(task.agent.partition(":")[0])  # check_task has imported it already
        if any(getattr(value, "__module__", None) == "polyrl.adapters.agents_sdk" or
               getattr(value, "__name__", None) == "polyrl.adapters.agents_sdk" for value in vars(module).values()):
            raise ValueError(f"tasks.{i}.agent: '{task.agent}' runs OpenAI Agents SDK agents, which are not "
                             "installed; pip install 'polyrl[agents]'")


def check_engine_hooks(config: Config) -> None:
    """Features that end or read rows while they are sampled need the HF engine's per-step hooks, which vLLM
    (one whole request at a time) does not have: agent tasks (the endpoint ends each request's rows at its own
    token limit and stop strings, streams tokens and drops a gone client's rows), early termination and ARPO
    (token entropies). Refused here rather than failing every rollout batch."""
    if config.engine.kind != "vllm":
        return
    agents = [i for i, task in enumerate(config.tasks) if task.agent is not None]
    if agents:
        raise ValueError(f"tasks.{agents[0]}.agent: agent tasks need engine.kind: hf (the endpoint ends rows "
                         "while they are sampled, which vllm cannot)")
    hooks = (("agents.early_stop", config.agents.early_stop.enabled), ("agents.arpo", config.agents.arpo.enabled))
    for key, on in hooks:
        if on:
            raise ValueError(f"{key}: needs engine.kind: hf (it reads each token as it is sampled, which vllm "
                             "cannot)")


def check_int8_model(config: Config) -> None:
    """``engine.int8_weights`` needs a model the fused decode path runs (its aliases are Llamas); a model
    directory's ``config.json`` names its type. A directory that is missing is left to the model loader."""
    if not config.engine.int8_weights:
        return
    from polyrl.engines.llama_decode import SUPPORTED_TYPES

    path = Path(config.model.name).expanduser() / "config.json"
    if not path.is_file():
        return
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"engine.int8_weights: model.name '{config.model.name}' is a '{model_type}' model; int8 "
                         f"sampling runs on the fused decode path, which covers {', '.join(SUPPORTED_TYPES)}")


def check_machine(config: Config) -> None:
    """What a run needs of this machine, checked by ``polyrl train`` before any model loads (not by
    ``load_config``: a config may be loaded to plan a run elsewhere). vLLM for ``engine.kind: vllm``, room on a
    local Ray for the learner rank actors and rollout workers asked for, free memory for their weights and
    trained state, a Ray cluster's address answering; a one-line ValueError (or the placement's own error)
    otherwise."""
    from polyrl.models.device import resolve_device
    from polyrl.placement import (
        check_ray_address,
        free_memory_bytes,
        local_placement_problem,
        memory_problem,
        model_parameters,
    )

    if config.engine.kind == "vllm" and find_spec("vllm") is None:
        from polyrl.engines import VLLM_INSTALL_HINT

        raise ValueError(VLLM_INSTALL_HINT)
    if problem := local_placement_problem(config):
        raise ValueError(problem)
    device = resolve_device(config.train.device).type
    if problem := memory_problem(config, model_parameters(config.model.name), free_memory_bytes(), device):
        raise ValueError(problem)
    if config.runtime.kind == "ray":
        check_ray_address(config.runtime.ray_address)


def check_names(config: Config) -> None:
    """Every registered name in ``config`` exists and its keyword arguments fit; a one-line ValueError naming
    the key otherwise."""
    check_extras(config)
    check_algorithm(config.algorithm, config.rollout.group_size)
    for i, stage in enumerate(config.stages):
        if stage.algorithm or "group_size" in stage.rollout:  # the structure was validated with the config
            try:
                merged = merge_algorithm(config.algorithm.model_dump(), stage.algorithm)
                group_size = stage.rollout.get("group_size", config.rollout.group_size)
                check_algorithm(AlgorithmConfig.model_validate(merged), group_size)
            except ValueError as exc:
                raise ValueError(f"stages.{i}.algorithm: {exc}") from None
    for i, task in enumerate(config.tasks):
        check_task(task, key=f"tasks.{i}")
    check_agent_sdk(config)
    check_engine_hooks(config)
    check_int8_model(config)


def load_config(path: str | Path | None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Load a YAML file (or a dict), apply dotted overrides, validate it and check its names; raise ConfigError
    on any problem."""
    config = parse_config(path, overrides, data)
    try:
        check_names(config)
    except ValueError as exc:
        raise ConfigError(f"{path if path is not None else 'config'}: {exc}") from None
    return config
