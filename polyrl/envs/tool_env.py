"""``ToolEnv``: the base of tool-using envs; it runs the tool calls a model makes and answers with results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from polyrl.envs.base import Env, Message, StepResult
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall, ToolParser
from polyrl.envs.tools import Tool, ToolError, as_tool


def call_with_timeout(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> str:
    """``tool(arguments)`` in a thread of its own; ToolError when it runs past ``timeout_s`` (the thread is left
    to finish, or not, on its own: daemonic, it never holds the process open)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("result", tool(arguments)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            outcome.append(("error", exc))

    worker = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise ToolError(f"tool '{tool.name}' ran past tasks[].tool_timeout_s ({timeout_s:g} s)")
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def tool_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}


class ToolEnv(Env):
    """A multi-turn env where the model calls tools until it replies without a call, which is its final
    answer and is scored by ``score``. Subclasses implement ``reset`` and ``score``.

    A malformed call, an unknown tool or a failing tool is answered with an ``Error: ...`` observation,
    ``info["tool_error"]`` and a reward of ``-tool_error_penalty``; the episode goes on.

    ``tool_latency_s`` (``tasks[].tool_latency_s``) makes every call that reaches a tool take at least that
    long, as a remote tool would; the calls of one reply run one after another. A call still running after
    ``tool_timeout_s`` (``tasks[].tool_timeout_s``) is answered with an error: the tool runs in a thread of its
    own, which Python cannot stop, so a tool that may hang for good should bound its own waits too.
    """

    max_turns = 4
    concurrent_steps = True
    tool_latency_s: float = 0.0
    tool_timeout_s: float = 30.0

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
            return call_with_timeout(tool, call.arguments, self.tool_timeout_s)
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
