"""What an episode's calls become: trajectories with the exact tokens and log-probs the policy sampled.

Calls are taken in order. A call whose prompt starts with an open trajectory's tokens (its earlier prompt and
reply, token for token) extends it: the tokens between are env tokens (tool results, the next user turn,
template text), masked out of the loss; the reply's tokens are the model's. A call that extends nothing
starts a trajectory of its own, its prompt masked. So a chat loop that keeps its history becomes one
multi-turn trajectory ("merged"), and an agent whose template or history rewriting breaks the prefix gives
one trajectory per call ("split"), all sharing the episode's reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl.endpoint.chat import Sample
from polyrl.types import Trajectory


@dataclass
class Call:
    prompt_ids: list[int]
    samples: list[Sample]


@dataclass
class EpisodeCapture:
    """Everything one episode sent through its base URL."""

    episode_id: str
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Requests answered with an error (a bad request from the agent)."""
    resampled: int = 0
    """Replies sampled again because they did not make the call ``tool_choice`` asked for."""
    open: bool = True


@dataclass
class _Building:
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    spans: list[tuple[int, int]] = field(default_factory=list)
    calls: int = 0
    truncated: bool = False

    def add_reply(self, sample: Sample) -> None:
        start = len(self.ids)
        self.ids += sample.token_ids
        self.loss_mask += [1] * len(sample.token_ids)
        self.logprobs += sample.logprobs
        self.spans.append((start, len(self.ids)))
        self.calls += 1
        self.truncated = not sample.eos and not sample.cut_at_stop_string


def assemble(calls: list[Call]) -> tuple[list[_Building], int]:
    """The trajectories an episode's calls make, and how many calls (choices) extended an earlier one; the
    others, after the first, each started a trajectory of their own."""
    built: list[_Building] = []
    merged = 0
    for call in calls:
        extended: set[int] = set()
        for sample in call.samples:
            # The longest open trajectory this prompt continues, not yet extended by this call's other choices.
            best = None
            for i, b in enumerate(built):
                if i not in extended and len(b.ids) <= len(call.prompt_ids) and call.prompt_ids[: len(b.ids)] == b.ids \
                        and (best is None or len(b.ids) > len(built[best].ids)):
                    best = i
            if best is None:
                p = list(call.prompt_ids)
                b = _Building(p, [0] * len(p), [0.0] * len(p))
                built.append(b)
                extended.add(len(built) - 1)
            else:
                b = built[best]
                env = call.prompt_ids[len(b.ids):]
                b.ids += env
                b.loss_mask += [0] * len(env)
                b.logprobs += [0.0] * len(env)
                extended.add(best)
                merged += 1
            b.add_reply(sample)
    return built, merged


def to_trajectories(
    capture: EpisodeCapture, task: str, item_id: int, group_id: int, reward: float, version: int,
    info: dict[str, Any], tokenizer: Any,
) -> list[Trajectory]:
    """One episode's trajectories, each with the episode's reward; ``info["capture"]`` says how the calls
    were joined: ``merged`` (several calls, one trajectory), ``split`` (one per call or chain) or ``single``."""
    built, merged = assemble(capture.calls)
    n_calls = sum(len(c.samples) for c in capture.calls)
    how = "split" if len(built) > 1 else ("merged" if n_calls > 1 else "single")
    out = []
    for b in built:
        prompt_len = b.loss_mask.index(1)
        out.append(Trajectory(
            task=task, item_id=item_id, group_id=group_id, input_ids=b.ids, loss_mask=b.loss_mask,
            logprobs=b.logprobs, versions=[version if m else -1 for m in b.loss_mask], turn_spans=b.spans,
            text=tokenizer.decode(b.ids[prompt_len:], skip_special_tokens=False),
            rewards={task: reward}, reward=reward, truncated=b.truncated,
            info={**info, "turns": b.calls, "capture": how, "episode": capture.episode_id,
                  "episode_calls": n_calls, "merged_calls": merged, "split_calls": len(built) - 1,
                  "resampled": capture.resampled},
        ))
    return out
