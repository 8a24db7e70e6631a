"""Tool-call formats, one parser per model family: find the calls in a reply, and describe the tools for chat
templates that have no slot for them.

A parser never raises on model output: a call it cannot read becomes an entry in ``Parsed.errors``, which the
environment turns into an error observation.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per call that could not be read (bad JSON, missing name, unclosed tag)."""

    @property
    def attempted(self) -> int:
        return len(self.calls) + len(self.errors)


def _call_from_json(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """A ``{"name": ..., "arguments": {...}}`` object as a ToolCall, or an error line."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" string'
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f'tool call "{name}": arguments are not valid JSON'
    if not isinstance(args, dict):
        return f'tool call "{name}": arguments must be a JSON object'
    return ToolCall(name, args)


def _collect(items: list[Any], parsed: Parsed, args_keys: tuple[str, ...] = ("arguments",)) -> None:
    for obj in items:
        call = _call_from_json(obj, args_keys)
        if isinstance(call, ToolCall):
            parsed.calls.append(call)
        else:
            parsed.errors.append(call)


def _tools_json(schemas: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(s) for s in schemas)


class ToolParser(ABC):
    name: str = ""

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The tool calls in one assistant reply; a reply with no call attempt is a final answer."""

    @abstractmethod
    def format_calls(self, calls: list[ToolCall]) -> str:
        """Write calls the way this model family does (for prompts, docs and scripted tests)."""

    @abstractmethod
    def tool_prompt(self, schemas: list[dict[str, Any]]) -> str:
        """System-prompt text that lists the tools, for chat templates that do not render ``tools``."""


_TAGGED = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class _TaggedParser(ToolParser):
    """``<tool_call>...</tool_call>`` blocks holding JSON; shared by the SmolLM2 and Hermes formats."""

    def parse(self, text: str) -> Parsed:
        parsed = Parsed()
        for body, close in _TAGGED.findall(text):
            if not close:
                parsed.errors.append("unclosed <tool_call> tag")
                continue
            try:
                obj = json.loads(body.strip())
            except json.JSONDecodeError as exc:
                parsed.errors.append(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
                continue
            # SmolLM2 writes a list of calls in one block; Hermes one object per block. Read both.
            _collect(obj if isinstance(obj, list) else [obj], parsed)
        return parsed


class SmolLM2Parser(_TaggedParser):
    """SmolLM2's function-calling format: a JSON list of calls inside one ``<tool_call>`` block."""

    name = "smollm2"

    def format_calls(self, calls: list[ToolCall]) -> str:
        body = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
        return f"<tool_call>{body}</tool_call>"

    def tool_prompt(self, schemas: list[dict[str, Any]]) -> str:
        # The wording SmolLM2-Instruct was tuned with for function calling, shortened.
        return (
            "You have access to the following tools:\n"
            f"<tools>{_tools_json(schemas)}</tools>\n\n"
            "To call tools, reply with a JSON list inside <tool_call></tool_call> tags, for example:\n"
            '<tool_call>[{"name": "func_name", "arguments": {"argument1": "value1"}}]</tool_call>\n'
            "Tool results come back in a message from the tool. When you have the answer, reply without a "
            "tool call."
        )


class HermesParser(_TaggedParser):
    """Hermes / Qwen2.5 format: one ``<tool_call>\\n{json}\\n</tool_call>`` block per call."""

    name = "hermes"

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}) + "\n</tool_call>"
            for c in calls
        )

    def tool_prompt(self, schemas: list[dict[str, Any]]) -> str:
        # Qwen2.5's own template text, used only when a template cannot render tools itself.
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tools_json(schemas)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Llama3Parser(ToolParser):
    """Llama 3.1+ JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``. A reply is a call attempt when it starts with either."""

    name = "llama3"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        parsed = Parsed()
        body = text.strip()
        tagged = body.startswith(self.TAG)
        body = body.removeprefix(self.TAG).strip()
        if not (tagged or body.startswith("{")):
            return parsed
        decoder, pos, items = json.JSONDecoder(), 0, []
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                parsed.errors.append(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
                break
            items.append(obj)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        _collect(items, parsed, args_keys=("parameters", "arguments"))
        return parsed

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)

    def tool_prompt(self, schemas: list[dict[str, Any]]) -> str:
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables.\n\n"
            f"{_tools_json(schemas)}\n\nWhen you have the answer, reply in plain text."
        )


PARSERS: dict[str, type[ToolParser]] = {
    "smollm2": SmolLM2Parser,
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
}


def parser_names() -> list[str]:
    return ["auto", *sorted(PARSERS)]


def check_parser_name(name: str, key: str = "tool_parser") -> None:
    if name not in parser_names():
        raise ValueError(f"{key}: unknown tool parser '{name}'; valid: {', '.join(parser_names())}")


def detect_parser(chat_template: str | None) -> str:
    """Guess the family from the chat template text; SmolLM2 (whose template has no tool slot) otherwise."""
    template = chat_template or ""
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3"
    if "<tool_call>" in template:
        return "hermes"
    return "smollm2"


def get_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser named ``name``; ``auto`` reads the tokenizer's chat template."""
    check_parser_name(name)
    if name == "auto":
        name = detect_parser(getattr(tokenizer, "chat_template", None))
    return PARSERS[name]()
