"""Tools are plain typed Python functions; ``ToolEnv`` runs the calls a model makes and answers with results.

A tool's JSON schema comes from its signature and Google-style docstring (transformers' ``get_json_schema``,
the same builder chat templates expect), so a tool is written once and rendered by each model's own template.
"""

from __future__ import annotations

import inspect
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.envs.base import Env, Message, StepResult
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall, ToolParser

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


def tool_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}


class ToolEnv(Env):
    """A multi-turn env where the model calls tools until it replies without a call, which is its final
    answer and is scored by ``score``. Subclasses implement ``reset`` and ``score``.

    A malformed call, an unknown tool or a failing tool is answered with an ``Error: ...`` observation,
    ``info["tool_error"]`` and a reward of ``-tool_error_penalty``; the episode goes on.

    ``tool_latency_s`` (``tasks[].tool_latency_s``) makes every call that reaches a tool take at least that
    long, as a remote tool would; the calls of one reply run one after another.
    """

    max_turns = 4
    concurrent_steps = True
    tool_latency_s: float = 0.0

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        tool_parser: ToolParser | None = None,
        tool_error_penalty: float = 0.0,
        max_calls_per_turn: int = 4,
    ) -> None:
        self.tools = [as_tool(t) for t in tools]
        self.tool_parser = tool_parser or SmolLM2Parser()
        self.tool_error_penalty = tool_error_penalty
        self.max_calls_per_turn = max_calls_per_turn
        self._by_name = {t.name: t for t in self.tools}

    def score(self, answer: str) -> float:
        """The reward of a final answer (the reply with no tool call)."""
        raise NotImplementedError

    def call(self, call: ToolCall) -> str:
        tool = self._by_name.get(call.name)
        if tool is None:
            raise ToolError(f"unknown tool '{call.name}'; available: {', '.join(self._by_name)}")
        start = time.monotonic()
        try:
            return tool(call.arguments)
        finally:
            # A remote tool answers a failing call as slowly as a good one, so errors wait too.
            wait = self.tool_latency_s - (time.monotonic() - start)
            if wait > 0:
                time.sleep(wait)

    def step(self, assistant_message: str) -> StepResult:
        parsed = self.tool_parser.parse(assistant_message)
        if parsed.attempted == 0:
            score = self.score(assistant_message)
            return StepResult([], score, True, {"score": score, "tool_calls": 0, "valid_tool_calls": 0})
        observations = [tool_message("error", f"Error: {e}") for e in parsed.errors]
        errors = list(parsed.errors)
        valid = 0
        for i, call in enumerate(parsed.calls):
            if i >= self.max_calls_per_turn:
                errors.append(f"too many tool calls in one turn (at most {self.max_calls_per_turn})")
                observations.append(tool_message(call.name, f"Error: {errors[-1]}"))
                break
            try:
                observations.append(tool_message(call.name, self.call(call)))
                valid += 1
            except ToolError as exc:
                errors.append(str(exc))
                observations.append(tool_message(call.name, f"Error: {exc}"))
        info: dict[str, Any] = {"tool_calls": parsed.attempted, "valid_tool_calls": valid}
        if errors:
            info["tool_error"] = errors[0]
        reward = -self.tool_error_penalty if errors and self.tool_error_penalty else 0.0
        return StepResult(observations, reward, False, info)
