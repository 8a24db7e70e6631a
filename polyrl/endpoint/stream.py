"""``stream: true``: a chat completion as OpenAI's server-sent events.

Each event is ``data: <chat.completion.chunk>``: first every choice's ``role``, then text deltas as tokens are
sampled, then each choice's last chunk with its ``finish_reason``, then (``stream_options.include_usage``) a
chunk with ``usage`` and no choices, then ``data: [DONE]``. The streamed text of a choice, concatenated, is the
``content`` a non-streamed request gets: text that may still turn out to begin a stop string, or that ends
inside a character spread over several tokens, is held back until it is settled.

A request whose replies are read for tool calls (``tools`` given, ``tool_choice`` not ``none``) is not streamed
token by token: whether a reply is a call is known when it is complete, and ``tool_choice`` may sample it
again. Its choices come in one delta each when they are done: their ``content`` and their ``tool_calls``
(each with its ``index``, ``id``, ``type`` and the whole ``function.arguments``). So does a request with
``top_logprobs`` (the engine's per-step hook sees the sampled token's log-prob only).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


def token_logprob(tokenizer: Any, token_id: int, logprob: float,
                  top: list[tuple[int, float]] | None = None) -> dict[str, Any]:
    """One entry of OpenAI's ``logprobs.content``, with the most likely tokens at its step when ``top``."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top or []]}


class TextStream:
    """One choice's text as its tokens arrive: each ``push`` returns what can be sent and never taken back."""

    def __init__(self, tokenizer: Any, stop_ids: set[int], stops: list[str]) -> None:
        self.tokenizer, self.stop_ids, self.stops = tokenizer, stop_ids, stops
        self.ids: list[int] = []
        self.sent = ""
        self.ended = False
        """A stop string has appeared: nothing after it is content."""

    def push(self, token_id: int) -> str:
        if self.ended or token_id in self.stop_ids:  # the model's stop token ends the reply; it is not content
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            text, self.ended = text[: min(hits)], True
        elif text.endswith("\ufffd"):  # a character whose bytes are not all sampled yet
            return ""
        else:
            text = text[: len(text) - self._held(text)]
        new = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += new
        return new

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[len(text) - k:])), default=0)

    def rest(self, content: str) -> str:
        """What is left to send of the choice's final ``content``."""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


def sse(data: Any) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def chunks(
    head: dict[str, Any],
    n: int,
    tokens: Any,
    streams: list[TextStream] | None,
    logprobs: Callable[[int, float], dict[str, Any]] | None,
    finish: Awaitable[tuple[list[dict[str, Any]], dict[str, Any]]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The events of one streamed completion.

    ``head`` holds the fields every chunk repeats (id, created, model); ``tokens`` is the job's queue of
    (choice, token id, log-prob), None-terminated, read when ``streams`` follow the text token by token;
    ``logprobs`` makes a token's log-prob entry when they were asked for; ``finish`` is the completion: its
    choices (as a non-streamed response has them) and usage.
    """
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": choices,
                    **extra})

    def delta(i: int, fields: dict[str, Any], entries: list[dict[str, Any]] | None = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": i, "delta": fields, "logprobs": None if entries is None else {"content": entries},
                "finish_reason": finish_reason}

    for i in range(n):
        yield chunk([delta(i, {"role": "assistant", "content": ""})])
    if streams is not None:
        while (item := await tokens.get()) is not None:
            i, token_id, logprob = item
            text = streams[i].push(token_id)
            content_token = token_id not in streams[i].stop_ids  # the stop token is not content: no entry
            entries = [logprobs(token_id, logprob)] if logprobs is not None and content_token else None
            if text or entries:
                yield chunk([delta(i, {"content": text}, entries)])
    try:
        choices, usage = await finish
    except Exception as exc:  # noqa: BLE001 - the answer is under way (status 200): the error comes as an event
        yield sse({"error": {"message": f"the engine failed: {type(exc).__name__}: {exc}", "type": "server_error",
                             "param": None, "code": None}})
        return
    for i, choice in enumerate(choices):
        message = choice["message"]
        if streams is not None:
            rest = streams[i].rest(message["content"] or "")
            if rest:
                yield chunk([delta(i, {"content": rest})])
        else:
            fields: dict[str, Any] = {"content": message["content"]}
            if message.get("tool_calls"):
                fields["tool_calls"] = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            entries = choice["logprobs"]["content"] if choice["logprobs"] is not None else None
            yield chunk([delta(i, fields, entries)])
        yield chunk([delta(i, {}, finish_reason=choice["finish_reason"])])
    if include_usage:
        yield sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": [],
                   "usage": usage})
    yield sse("[DONE]")
