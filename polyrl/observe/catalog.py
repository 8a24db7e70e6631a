"""What ``polyrl tasks`` lists: registered environments and reasoning-gym datasets, one line each.

Descriptions come from docstrings (the first sentence-ish line), else the class name; nothing is instantiated,
so listing stays fast.
"""

from __future__ import annotations

import re

from polyrl.envs.base import ENVS

MAX_CHARS = 100
_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")


def one_line(doc: str | None, fallback: str) -> str:
    """The first paragraph of a docstring on one line: markdown links reduced to their text, cut at
    ``MAX_CHARS``; ``fallback`` when there is no docstring."""
    text = (doc or "").strip().split("\n\n")[0]
    text = " ".join(_LINK.sub(r"\1", text).split())
    if not text:
        return fallback
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1].rstrip() + "…"


def reasoning_gym_tasks() -> list[tuple[str, str]]:
    from reasoning_gym.factory import DATASETS

    out = []
    for name, entry in sorted(DATASETS.items()):
        cls = entry[0] if isinstance(entry, tuple) else entry
        out.append((name, one_line(getattr(cls, "__doc__", None), getattr(cls, "__name__", name))))
    return out


def environments() -> list[tuple[str, str]]:
    """Registered environments (``polyrl.envs.base.ENVS``)."""
    out = []
    for name, spec in sorted(ENVS.items()):
        doc = getattr(spec, "doc", "") or getattr(getattr(spec, "factory", None), "__doc__", None)
        out.append((name, one_line(doc, name)))
    return out
