"""Tools are plain typed Python functions; ``ToolEnv`` (envs/tool_env.py) runs the calls a model makes.

A tool's JSON schema comes from its signature and Google-style docstring (transformers' ``get_json_schema``,
the same builder chat templates expect), so a tool is written once and rendered by each model's own template.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESULT_CHARS = 2000
"""Tool results are cut to this length: one runaway result must not eat the token budget."""


class ToolError(Exception):
    """A call the tool could not serve (bad arguments, or the tool failed); becomes an error observation."""


_JSON_TYPES: dict[Any, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
    list: (list,),
    dict: (dict,),
}


def _accepts(annotation: Any, value: Any) -> bool:
    """Does a JSON value fit a parameter annotation? Unknown annotations accept anything."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    allowed = _JSON_TYPES.get(origin or annotation)
    if allowed is None:
        return True
    if isinstance(value, bool) and bool not in allowed:  # JSON true is not a number
        return False
    return isinstance(value, allowed)


@dataclass
class Tool:
    """A Python function the model may call by name with JSON arguments."""

    fn: Callable[..., Any]
    name: str
    schema: dict[str, Any]
    """OpenAI-style ``{"type": "function", "function": {...}}``, as ``apply_chat_template`` takes it."""

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - the builder raises several types; one clear message
            name = getattr(fn, "__name__", fn)
            raise ValueError(f"tool '{name}': cannot build its JSON schema: {exc}") from None
        return cls(fn, schema["function"]["name"], schema)

    def __call__(self, arguments: dict[str, Any]) -> str:
        """Run the tool; raise ToolError with a message fit to show the model."""
        sig = inspect.signature(self.fn)
        try:
            bound = sig.bind(**arguments)
        except TypeError as exc:
            raise ToolError(f"bad arguments for {self.name}: {exc}") from None
        hints = typing.get_type_hints(self.fn)
        for arg, value in bound.arguments.items():
            if not _accepts(hints.get(arg, inspect.Parameter.empty), value):
                want = getattr(hints[arg], "__name__", str(hints[arg]))
                raise ToolError(f"bad arguments for {self.name}: '{arg}' must be {want}, got {value!r}")
        try:
            result = self.fn(*bound.args, **bound.kwargs)
        except ToolError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure inside a tool is reported to the model
            raise ToolError(f"{self.name} failed: {exc}") from None
        text = result if isinstance(result, str) else str(result)
        return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ...[truncated]"


def as_tool(tool: Tool | Callable[..., Any]) -> Tool:
    return tool if isinstance(tool, Tool) else Tool.from_function(tool)
