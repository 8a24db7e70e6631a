"""The policy being trained as a chat function, for envs where it also plays another part (self-play: the other
seat of a two-player game). What it generates is part of the env, never of a trajectory: nothing it samples is
trained on."""

from __future__ import annotations

from typing import Any

from polyrl.envs.base import Message
from polyrl.rollout.render import ChatRenderer


class EnginePolicy:
    """``(messages, seed) -> reply`` from ``engine`` with whatever weights it holds (a training run's engine: the
    current policy, refreshed by every weight sync).

    The messages are rendered with the tokenizer's chat template, as a policy turn's prompt is; one completion is
    sampled at ``temperature`` / ``top_p`` from ``seed`` and decoded as the rollout decodes a reply (special
    tokens kept, the final stop token dropped). Every engine seeds a sampler of its own per ``generate`` call,
    so a call here draws nothing from the rollout's streams or the global RNG.
    """

    def __init__(self, engine: Any, max_new_tokens: int, temperature: float, top_p: float = 1.0) -> None:
        self.engine, self.max_new_tokens, self.temperature, self.top_p = engine, max_new_tokens, temperature, top_p

    def __call__(self, messages: list[Message], seed: int) -> str:
        tokenizer = self.engine.tokenizer
        _, prompt = ChatRenderer(tokenizer).prompt(messages)
        ((completion,),) = self.engine.generate([prompt], 1, self.max_new_tokens, self.temperature, self.top_p, seed)
        ids = completion.token_ids
        if ids and ids[-1] in self.engine.stop_ids:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
