"""Single-turn entry points, kept for callers that predate the env protocol: a single-turn task is the
one-step case of the multi-turn loop, so these delegate to ``polyrl.rollout.multi_turn``."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from polyrl.rollout.multi_turn import evaluate, rollout

__all__ = ["encode_prompt", "evaluate", "rollout"]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Render with the model's own chat template and tokenize without adding special tokens twice."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
