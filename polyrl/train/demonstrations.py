"""Multi-turn SFT examples from an env's own demonstrations (tool-call warm starts).

An env that can solve its items itself offers ``demonstration(item) -> list[str] | None``: the assistant
replies of a solved episode (for ``tool_math``: a calculate call in the env's tool-call format, then the
result). Each reply is played through the same code path as a rollout (``start_episode`` / ``advance``), with
the reply's tokens standing in for sampled ones, so the example holds exactly the tokens a rollout would
(tool results and chat-template text between turns included) and the env itself parses the calls and scores
the final answer. Only the assistant replies (each with its stop token) carry loss_mask 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.engines.hf import Completion
from polyrl.envs.base import Task
from polyrl.rollout.multi_turn import Episode, advance, start_episode, to_trajectory
from polyrl.types import Trajectory


@dataclass
class _Scripted:
    """What ``advance`` needs of an engine: the tokenizer and the stop tokens."""

    tokenizer: PreTrainedTokenizerBase
    stop_ids: set[int]


def play_replies(episode: Episode, replies: list[str], tokenizer) -> str | None:
    """Play ``replies`` as the model's turns of ``episode``; None when the env accepted them and scored the
    episode 1, else what went wrong (training on it would teach the wrong thing)."""
    engine = _Scripted(tokenizer, {tokenizer.eos_token_id})
    for reply in replies:
        if episode.done:
            return "the episode ended before the demonstration did"
        # The reply as the model would emit it: its text's tokens, then the stop token.
        ids = [*episode.renderer.encode(reply), tokenizer.eos_token_id]
        advance(episode, Completion(ids, [0.0] * len(ids), finished=True), len(ids), -1, engine)  # type: ignore[arg-type]
    if not episode.env_done or episode.last_info.get("score") != 1.0:
        return "the env does not score its own demonstration 1"
    if episode.valid_tool_calls != episode.tool_calls:
        return "the demonstration makes a call the env rejects"
    return None


def env_demonstration(episode: Episode) -> list[str] | None:
    """The assistant replies of the episode's item solved by its env, when the env offers them."""
    demonstrate = getattr(episode.env, "demonstration", None)
    return demonstrate(episode.item) if demonstrate is not None else None


def demonstration_example(task: Task, index: int, item: dict[str, Any], tokenizer) -> Trajectory | None:
    """The item's demonstration as a trajectory, or None when the env gives none for it.

    Raises ValueError when the env does not accept its own demonstration (a call it cannot parse, or a final
    answer it does not score 1).
    """
    episode = start_episode(task, index, item, index, tokenizer)
    replies = env_demonstration(episode)
    if not replies:
        return None
    problem = play_replies(episode, replies, tokenizer)
    if problem is not None:
        raise ValueError(f"task '{task.name}': item {index}: {problem}")
    trajectory = to_trajectory(episode, tokenizer)
    trajectory.text = "\n".join(replies)
    return trajectory
