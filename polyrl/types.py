"""The contract every stage reads and writes: ``Trajectory``, a plain dataclass that serialises to JSON lines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One sampled interaction with its tokens, masks, behaviour log-probs, rewards and provenance.

    ``input_ids`` hold the whole interaction (prompt, model turns, env turns). ``loss_mask`` is 1 on tokens the
    model produced. ``logprobs`` and ``versions`` are aligned with ``input_ids``: the behaviour log-prob and the
    policy version of each produced token (0.0 / -1 elsewhere).
    """

    task: str
    item_id: int
    group_id: int
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    text: str = ""
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    advantage: float = 0.0
    token_advantages: list[float] | None = None
    """Per-token advantages aligned with ``input_ids`` (step-level credit, ARPO's shared prefixes); when set,
    the learner uses them instead of ``advantage``."""
    truncated: bool = False
    terminated_early: bool = False
    replayed: bool = False
    guided: bool = False
    """A reference reply the policy did not sample (``guidance``): its log-probs are the current policy's,
    and the loss treats its tokens as off-policy."""
    hinted: bool = False
    """Sampled from a prompt given the start of the reference reply (``guidance.hint_fraction``): trained as
    any sample, left out of rewards and pass rates (the hint, not the policy alone, earned them)."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        """Index of the first model-produced token."""
        for i, m in enumerate(self.loss_mask):
            if m:
                return i
        return len(self.loss_mask)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        data = json.loads(line)
        data["turn_spans"] = [tuple(s) for s in data.get("turn_spans", [])]
        return cls(**data)
