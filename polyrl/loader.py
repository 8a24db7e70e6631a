"""``module:attr`` references to the user's own code, resolved from the working directory.

A config names an agent (``tasks[].agent``) or an env factory (``tasks[].env``) as ``"my_pkg.agents:run"``;
the module is imported with the current directory on ``sys.path``, so a file next to the config is enough (no
launcher script, no installation). Every failure is one line naming the config key.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Any

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_FILE_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_][\w.]*)$")


def is_reference(text: str | None) -> bool:
    """Is ``text`` a ``module:attr`` reference (rather than a registered name)?"""
    return text is not None and ":" in text


def load_object(reference: str, key: str) -> Any:
    """Import ``module`` and return ``attr`` (dots walk into attributes: ``pkg.mod:Class.method``); the module
    may also be a file, ``path/to/rewards.py:score`` (as verl's ``custom_reward_function.path`` names one)."""
    if (file_spec := _FILE_SPEC.match(reference)) is not None:
        return _load_from_file(file_spec["path"], file_spec["attr"], key)
    if not _SPEC.match(reference):
        raise ValueError(f"{key}: '{reference}' is not a module:attr reference (e.g. my_pkg.agents:run)")
    module_name, _, attr = reference.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:  # the user's code sits beside the config, where polyrl is run from
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ValueError(f"{key}: no module named '{exc.name}' (looked in {cwd} and the installed packages)") \
                from None
        raise ValueError(f"{key}: importing '{module_name}' failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything at import
        raise ValueError(f"{key}: importing '{module_name}' failed: {type(exc).__name__}: {exc}") from None
    return _attribute(obj, module_name, attr, key)


def _attribute(obj: Any, module_name: str, attr: str, key: str) -> Any:
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def _load_from_file(path: str, attr: str, key: str) -> Any:
    """A module imported from its file, once per path (named after its absolute path)."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ValueError(f"{key}: no such file '{path}'")
    name = "polyrl_user_" + re.sub(r"\W", "_", full)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's module may raise anything at import
            del sys.modules[name]
            raise ValueError(f"{key}: importing '{path}' failed: {type(exc).__name__}: {exc}") from None
    return _attribute(sys.modules[name], path, attr, key)
