"""``module:attr`` references to the user's own code, resolved from the working directory.

A config names an agent (``tasks[].agent``) or an env factory (``tasks[].env``) as ``"my_pkg.agents:run"``;
the module is imported with the current directory on ``sys.path``, so a file next to the config is enough (no
launcher script, no installation). Every failure is one line naming the config key.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_reference(text: str | None) -> bool:
    """Is ``text`` a ``module:attr`` reference (rather than a registered name)?"""
    return text is not None and ":" in text


def load_object(reference: str, key: str) -> Any:
    """Import ``module`` and return ``attr`` (dots walk into attributes: ``pkg.mod:Class.method``)."""
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
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj
