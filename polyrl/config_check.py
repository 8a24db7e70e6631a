"""Loading a run's config: parse it (``polyrl.config``, pure data), then check the names it gives against the
registries of envs, advantage estimators, policy losses and off-policy corrections.

The check sits here, above both the config and the registries, so that the config never imports what it
configures. Every error is still one line that names the file and key.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from polyrl.algorithms.validate import check_algorithm
from polyrl.config import AlgorithmConfig, Config, ConfigError, parse_config
from polyrl.envs.base import check_task


def check_extras(config: Config) -> None:
    """The optional packages the config asks for are installed (found without importing them), so a missing
    one fails here, with its install command, not after the model has loaded. (vLLM is checked where the
    engine is made: plans of GPU runs load vLLM configs on machines without it.)"""
    if config.runtime.kind == "ray" and find_spec("ray") is None:
        raise ValueError("runtime.kind: ray is not installed; pip install 'polyrl[ray]'")


def check_names(config: Config) -> None:
    """Every registered name in ``config`` exists and its keyword arguments fit; a one-line ValueError naming
    the key otherwise."""
    check_extras(config)
    check_algorithm(config.algorithm)
    for i, stage in enumerate(config.stages):
        if stage.algorithm:  # the structure was validated with the config; here the names it picks
            try:
                check_algorithm(AlgorithmConfig.model_validate({**config.algorithm.model_dump(), **stage.algorithm}))
            except ValueError as exc:
                raise ValueError(f"stages.{i}.algorithm: {exc}") from None
    for i, task in enumerate(config.tasks):
        check_task(task, key=f"tasks.{i}")


def load_config(path: str | Path | None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Load a YAML file (or a dict), apply dotted overrides, validate it and check its names; raise ConfigError
    on any problem."""
    config = parse_config(path, overrides, data)
    try:
        check_names(config)
    except ValueError as exc:
        raise ConfigError(f"{path if path is not None else 'config'}: {exc}") from None
    return config
