"""Hints for groups whose samples all fail (``guidance.hint_fraction``, docs/guidance.md).

GHPO (Liu et al. 2025, "GHPO: Adaptive Guidance for Stable and Efficient LLM Reinforcement Learning") and
QuestA (Li et al. 2025, "QuestA: Expanding Reasoning Capacity in LLMs via Question Augmentation") show a
prompt the policy cannot yet solve the start of a reference solution inside the prompt, and sample it again:
with part of the way given, some samples succeed and the group has differences to learn from. The hint is
annealed away, so that the policy ends up solving the bare prompt.

Here each group still all-fail after success replay is rolled out again as a new group, the last user message
of its prompt ending with ``hint_template``. Those samples are on-policy for the hinted prompt (their prompt
tokens are the hinted ones), so they are trained as any sampled group; rewards and pass rates leave them out
(``Trajectory.hinted``), since the hint earned part of them. The original group stays, its advantage zero.
Reference mixing (``polyrl.train.guidance``) runs afterwards, over the hinted groups too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from polyrl.config import GuidanceConfig
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Env, Message, Task
from polyrl.rollout.multi_turn import start_episode
from polyrl.train.agents import Requests
from polyrl.train.demonstrations import play_replies
from polyrl.train.guidance import Guidance, all_fail_groups
from polyrl.types import Trajectory

HINT_SEED_OFFSET = 300_007_001
"""A round's hinted groups draw from a seed of their own, this far from the round's."""

HintedRoll = Callable[[Requests, int, int], list[Trajectory]]
"""``roll(requests, seed, first_group_id)``: roll out and score one group per request, as a round's groups are
(reward components, monitors)."""


def hint_fraction(config: GuidanceConfig, step: int) -> float:
    """The share of the reference reply revealed at ``step``: ``hint_fraction``, falling linearly to 0 over
    ``hint_anneal_steps`` (as ``anneal_steps`` does for the reference's probability); a function of the step
    alone, so a resumed run hints what the uninterrupted one did."""
    if config.hint_anneal_steps <= 0:
        return config.hint_fraction
    return config.hint_fraction * max(0.0, 1.0 - (step - 1) / config.hint_anneal_steps)


def hint_text(reply: str, fraction: float) -> str:
    """The first floor(``fraction`` x len) characters of ``reply``; a reply of several words is cut back to the
    last whitespace, so that no word is split. "" means no hint (nothing left to reveal)."""
    n = math.floor(fraction * len(reply) + 1e-9)  # 1e-9: 0.29 * 100 is 28.999... in floating point
    text = reply[:n]
    if len(reply.split()) > 1 and 0 < n < len(reply) and not reply[n].isspace() and not reply[n - 1].isspace():
        text = text[: max((i for i, c in enumerate(text) if c.isspace()), default=0)]
    return text.rstrip() if text.strip() else ""


def with_hint(messages: list[Message], text: str) -> list[Message]:
    """``messages`` with ``text`` appended to the last user message (copies: the env's own list is left as is)."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            message["content"] += text
            return out
    raise ValueError("a hinted prompt needs a user message with text content")


def _hinted_env(task: Task, text: str) -> Env:
    env = task.make_env()
    reset = env.reset
    # Only this instance's reset changes: the env keeps its class and state, which batch scorers may read.
    env.reset = lambda item: with_hint(reset(item), text)  # type: ignore[method-assign]
    return env


def hinted_task(task: Task, text: str) -> Task:
    """A copy of ``task`` whose envs open with ``text`` appended to the last user message; items, reference
    replies and scoring are the task's own."""
    hinted = copy.copy(task)
    hinted.make_env = partial(_hinted_env, task, text)  # type: ignore[method-assign]
    return hinted


def reference_hint(task: Task, index: int, item: dict[str, Any], fraction: float, tokenizer: Any) -> str:
    """The start of ``item``'s reference reply (``Task.reference_reply``) to hint with; "" when the task is an
    agent's, the item has no reference, the env does not score the whole reply a success (a wrong reference
    would hint the wrong way), its prompt has no user text to extend, or the fraction reveals nothing."""
    if isinstance(task, AgentTask):  # an agent's prompts are its own client code's
        return ""
    reply = task.reference_reply(item)
    text = hint_text(reply, fraction) if reply else ""
    if not text:
        return ""
    episode = start_episode(task, index, item, 0, tokenizer)
    if not any(m.get("role") == "user" and isinstance(m.get("content"), str) for m in episode.messages):
        return ""
    return text if play_replies(episode, [reply], tokenizer) is None else ""


def add_hints(guidance: Guidance, trajectories: list[Trajectory], requests: dict[int, tuple[Task, int, dict[str, Any]]],
              step: int, seed: int, roll: HintedRoll) -> dict[str, float]:
    """Roll out each all-fail group's item again with a hint, as a new group numbered after every id in
    ``requests`` (group id -> task, item index, item), from ``seed`` + ``HINT_SEED_OFFSET``. The hinted samples
    are appended to ``trajectories`` and their groups to ``requests`` (both in place), marked ``hinted``.
    Returns ``guidance/hinted`` (groups re-sampled) and ``guidance/hinted_solved`` (of those, groups with a
    success); nothing when hints are off."""
    config = guidance.config
    if config.hint_fraction <= 0:
        return {}
    fraction, hinted_requests = hint_fraction(config, step), []
    if fraction > 0:
        for gid in sorted(all_fail_groups(trajectories, config.success_score)):
            task, index, item = requests[gid]
            text = reference_hint(task, index, item, fraction, guidance.tokenizer)
            if text:
                hinted_requests.append((hinted_task(task, config.hint_template.format(hint=text)), index, item))
    if not hinted_requests:
        return {"guidance/hinted": 0.0, "guidance/hinted_solved": 0.0}
    first = max(requests) + 1
    hinted = roll(hinted_requests, seed + HINT_SEED_OFFSET, first)
    for t in hinted:
        t.hinted = True
    requests.update({first + g: request for g, request in enumerate(hinted_requests)})
    trajectories.extend(hinted)
    solved = {t.group_id for t in hinted} - set(all_fail_groups(hinted, config.success_score))
    return {"guidance/hinted": float(len(hinted_requests)), "guidance/hinted_solved": float(len(solved))}
