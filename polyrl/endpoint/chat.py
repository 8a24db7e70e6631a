"""From OpenAI chat messages to prompt token ids, and from sampled tokens back to an OpenAI message.

Token faithfulness: when a request's messages are an earlier call's messages, then that call's reply (as the
endpoint returned it), then new messages, the prompt is the earlier prompt's token ids, the reply's sampled
token ids, and only the new text tokenised (the same continuation the native multi-turn rollout appends). A
request whose history differs, or whose chat template renders the earlier turns differently (templates that
drop earlier ``<think>`` blocks), is tokenised afresh; ``capture`` then finds that it does not extend.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.endpoint.protocol import RequestError
from polyrl.envs.base import Message
from polyrl.envs.tool_parsers import ToolCall, ToolParser
from polyrl.rollout.render import ChatRenderer

_TAG_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


@dataclass
class SchemaTool:
    """A tool known only by its schema (the agent runs it, not polyrl): what ``ChatRenderer`` reads."""

    schema: dict[str, Any]


@dataclass
class Sample:
    """One sampled choice of a call."""

    token_ids: list[int]
    logprobs: list[float]
    raw: str
    """The reply as conversation history holds it: decoded, the final stop token removed."""
    eos: bool
    """Ended on the model's stop token."""
    cut_at_stop_string: bool = False
    content: str = ""
    """What the endpoint returned as text (cut at a stop string when one matched)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the request's ``top_logprobs`` most likely tokens and their log-probs (when it asked)."""


@dataclass
class Rendered:
    messages: list[Message]
    context: str
    """The template text the prompt ids spell."""
    ids: list[int]


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}]: only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts", where)


def _calls(message: dict[str, Any], where: str) -> list[tuple[str | None, ToolCall]]:
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}]: needs function.name", f"{where}.tool_calls")
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments: not valid JSON",
                               f"{where}.tool_calls") from None
        calls.append((call.get("id"), ToolCall(fn["name"], parsed if isinstance(parsed, dict) else {})))
    return calls


def reply_key(content: str, calls: Sequence[ToolCall]) -> str:
    """Identifies a returned assistant message when an agent sends it back in its history."""
    return json.dumps([content.strip(), [[c.name, c.arguments] for c in calls]], sort_keys=True)


@dataclass
class Conversation:
    """One episode's (or one anonymous request's) rendering state."""

    tokenizer: PreTrainedTokenizerBase
    parser: ToolParser
    turns: list[tuple[Rendered, list[Sample]]] = field(default_factory=list)
    replies: dict[str, str] = field(default_factory=dict)
    """reply_key of each returned message -> the raw reply it came from."""

    def template_messages(self, messages: list[dict[str, Any]]) -> list[Message]:
        """OpenAI messages as the chat template takes them; replies this endpoint gave come back as sampled."""
        out: list[Message] = []
        names: dict[Any, str] = {}
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            role = m.get("role") if isinstance(m, dict) else None
            if role in ("system", "developer", "user"):
                out.append({"role": "user" if role == "user" else "system",
                            "content": _text(m.get("content"), f"{where}.content")})
            elif role == "assistant":
                content = _text(m.get("content"), f"{where}.content")
                calls = _calls(m, where)
                names.update({cid: c.name for cid, c in calls})
                raw = self.replies.get(reply_key(content, [c for _, c in calls]))
                if raw is None:  # a message the agent wrote itself: calls in the model's own format
                    written = self.parser.format_calls([c for _, c in calls]) if calls else ""
                    raw = "\n".join(s for s in (content, written) if s)
                out.append({"role": "assistant", "content": raw})
            elif role == "tool":
                name = m.get("name") or names.get(m.get("tool_call_id"), "tool")
                out.append({"role": "tool", "name": name, "content": _text(m.get("content"), f"{where}.content")})
            else:
                raise RequestError(f"{where}.role: unknown role {role!r}", f"{where}.role")
        return out

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Rendered:
        template = self.template_messages(messages)
        renderer = ChatRenderer(self.tokenizer, [SchemaTool(s) for s in tools], self.parser)  # type: ignore[misc]
        full = renderer.text(template, add_generation_prompt=True)
        stop_text = self.tokenizer.decode([self.tokenizer.eos_token_id])
        for earlier, samples in reversed(self.turns):
            k = len(earlier.messages)
            if len(template) <= k or template[:k] != earlier.messages or template[k]["role"] != "assistant":
                continue
            for s in samples:
                if s.cut_at_stop_string or template[k]["content"] != s.raw:
                    continue
                head = earlier.context + s.raw
                if not full.startswith(head):
                    continue  # the template rewrites the earlier turns
                tail = full[len(head):]
                if s.eos:  # the model produced the turn's end token itself
                    if not tail.startswith(stop_text):
                        continue
                    tail = tail[len(stop_text):]
                ids = earlier.ids + s.token_ids + renderer.encode(tail)
                return Rendered(template, full, ids)
        return Rendered(template, full, renderer.encode(full))

    def calls(self, sample: Sample) -> list[ToolCall]:
        """The tool calls a sample makes; none when any is malformed (the agent then sees what was said)."""
        parsed = self.parser.parse(sample.content)
        return parsed.calls if parsed.calls and not parsed.errors else []

    def reply(self, sample: Sample, parse_tools: bool) -> tuple[dict[str, Any], str]:
        """The OpenAI message of one sample and its finish reason; remembers it for later histories."""
        text = sample.content
        calls = self.calls(sample) if parse_tools else []
        if calls:
            content = _TAG_BLOCK.sub("", text).strip() if "<tool_call>" in text else ""
            message: dict[str, Any] = {
                "role": "assistant", "content": content or None,
                "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls],
            }
            finish = "tool_calls"
        else:
            content = text
            message = {"role": "assistant", "content": text}
            finish = "stop" if sample.eos or sample.cut_at_stop_string else "length"
        if not sample.cut_at_stop_string:
            self.replies[reply_key(content, calls)] = sample.raw
        return message, finish
