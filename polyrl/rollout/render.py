"""Chat rendering for token-faithful multi-turn rollouts.

The model's tokens are kept exactly as sampled; only what the environment adds is tokenised. Between two
model turns that is the template's text after the model's reply: the end of the assistant turn, the
observation messages, and the next generation prompt. It is found by rendering the conversation with the
new observation and taking what follows the text already in the context, so the trajectory reads exactly
as the chat template would render the final conversation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.envs.base import Message
from polyrl.envs.tool_parsers import ToolParser
from polyrl.envs.tools import Tool


def template_supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Does the chat template render a ``tools`` argument? (SmolLM2-135M's does not; Qwen's, Llama's do.)"""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return re.search(r"\btools\b", template or "") is not None


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn (it rewrites earlier turns)."""


class ChatRenderer:
    """Renders one env's conversations with the model's own template, tools included.

    When the template has no slot for tools, the parser's tool description is appended to the system
    message (or becomes one), the same way at every render so turns stay consistent.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[Tool] = (), parser: ToolParser | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.schemas = [t.schema for t in tools]
        self.native = bool(self.schemas) and template_supports_tools(tokenizer)
        self.tool_prompt = ""
        if self.schemas and not self.native:
            if parser is None:
                raise ValueError("an env with tools needs a tool parser when the template has no tools slot")
            self.tool_prompt = parser.tool_prompt(self.schemas)

    def _prepare(self, messages: list[Message]) -> list[Message]:
        if not self.tool_prompt:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.tool_prompt}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.tool_prompt}, *messages]

    def text(self, messages: list[Message], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tools": self.schemas} if self.native else {}
        return self.tokenizer.apply_chat_template(
            self._prepare(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Tokenise template text; its special tokens are already written out, so add none."""
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt(self, messages: list[Message]) -> tuple[str, list[int]]:
        text = self.text(messages, add_generation_prompt=True)
        return text, self.encode(text)

    def continuation(
        self,
        context: str,
        history: list[Message],
        reply: str,
        stop_text: str | None,
        observations: list[Message],
    ) -> tuple[str, list[int]]:
        """The env's tokens after a model reply: end of the assistant turn, observations, generation prompt.

        ``context`` is the text the model was prompted with (``history`` rendered with a generation prompt),
        ``reply`` the model's text without its stop token, ``stop_text`` that stop token's text when it
        stopped (the model already produced it, so it is not added again). Returns (text, token ids).
        """
        assistant = {"role": "assistant", "content": reply}
        full = self.text([*history, assistant, *observations], add_generation_prompt=True)
        head = context + reply
        # Templates that rewrite earlier turns (e.g. trim the reply) break the prefix; then fall back to the
        # template's wrapper around a neutral exchange, which does not depend on this conversation.
        tail = full[len(head) :] if full.startswith(head) else self._wrapper(observations)
        if stop_text is not None and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]
        return tail, self.encode(tail)

    def _wrapper(self, observations: list[Message]) -> str:
        base: list[Message] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        prompt = self.text(base, add_generation_prompt=True)
        reply: Message = {"role": "assistant", "content": "R"}
        replied = self.text([*base, reply], add_generation_prompt=False)
        full = self.text([*base, reply, *observations], add_generation_prompt=True)
        if not (replied.startswith(prompt + "R") and full.startswith(replied)):
            raise TemplateError(
                "the chat template does not extend a conversation turn by turn, so env tokens cannot be "
                "appended without re-tokenising the model's tokens"
            )
        return replied[len(prompt) + 1 :] + full[len(replied) :]
