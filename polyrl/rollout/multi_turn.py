"""Multi-turn rollouts over the env protocol; single-turn tasks are the one-step case of the same loop.

Trajectories are token-faithful: each model turn's tokens are kept exactly as sampled (never decoded and
re-encoded), env tokens are the chat template's text between turns (``ChatRenderer.continuation``), and only
model tokens carry loss_mask 1, a behaviour log-prob and a policy version. Each turn, every still-active
sample generates in one batch; the first turn shares each group's prompt prefill.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.config import RolloutConfig
from polyrl.engines.hf import Completion
from polyrl.engines.protocol import Engine
from polyrl.envs.base import Env, Message, StepResult, Task
from polyrl.parallel.group import contiguous_shards
from polyrl.rollout.early_stop import EarlyStopper
from polyrl.rollout.render import ChatRenderer
from polyrl.types import Trajectory

# Later turns draw from seeds far from the first turn's, which stays ``seed`` (as single-turn rollouts were).
TURN_SEED_STRIDE = 1_000_033
MAX_ENV_THREADS = 32
"""Most env steps of one turn that wait at once (``step_envs``); more queue for a free thread."""


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    # Special tokens stay (a parser may need e.g. <|python_tag|>); no clean-up, so text matches the tokens.
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class Episode:
    """One sample's interaction in progress."""

    task: Task
    item_id: int
    item: dict[str, Any]
    group_id: int
    env: Env
    renderer: ChatRenderer
    messages: list[Message]
    context: str
    """The conversation so far as template text (what ``ids`` spell)."""
    ids: list[int]
    max_turns: int
    max_tokens: int | None
    prompt_len: int = 0
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    env_done: bool = False
    truncated: bool = False
    last_info: dict[str, Any] = field(default_factory=dict)
    tool_calls: int = 0
    valid_tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    """A key of the environment state each turn starts from (GiGPO's step groups)."""
    terminated_early: bool = False
    tokens_saved: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.ids)
        self.loss_mask = [0] * self.prompt_len
        self.logprobs = [0.0] * self.prompt_len
        self.versions = [-1] * self.prompt_len

    def tokens_left(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens - (len(self.ids) - self.prompt_len)

    def turn_limit(self, max_new_tokens: int) -> int:
        left = self.tokens_left()
        return max_new_tokens if left is None else max(0, min(max_new_tokens, left))

    def finish(self, env_done: bool, truncated: bool) -> None:
        self.done, self.env_done, self.truncated = True, env_done, truncated

    def append(self, ids: list[int], logprobs: list[float] | None, version: int | list[int]) -> None:
        """Append model tokens (with ``logprobs``) or env tokens (``logprobs`` None). ``version`` may be one per
        token: a partial rollout's turn can span policy versions (polyrl/runtime/partial.py)."""
        model = logprobs is not None
        self.ids += ids
        self.loss_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if model else [0.0] * len(ids)
        if model and isinstance(version, list):
            self.versions += version
        else:
            self.versions += [version if model else -1] * len(ids)


def state_key(observation: list[Message], info: dict[str, Any] | None = None) -> str:
    """The env's own ``info["state"]`` when it gives one, else a digest of the observation messages."""
    if info and "state" in info:
        return str(info["state"])
    return hashlib.sha1(json.dumps(observation, sort_keys=True, default=str).encode()).hexdigest()[:16]


def start_episode(
    task: Task, item_id: int, item: dict[str, Any], group_id: int, tokenizer: PreTrainedTokenizerBase
) -> Episode:
    env = task.make_env()
    messages = list(env.reset(item))
    renderer = ChatRenderer(tokenizer, env.tools, env.tool_parser)
    context, ids = renderer.prompt(messages)
    max_turns = task.config.max_turns or env.max_turns
    episode = Episode(task, item_id, item, group_id, env, renderer, messages, context, ids, max_turns,
                      task.config.max_tokens)
    episode.states.append(state_key(messages))
    return episode


def stop_early(episode: Episode, completion: Completion, limit: int, version: int, reward: float) -> None:
    """End an episode whose turn the early-stop predicate cut: keep its tokens, give it ``reward``."""
    e = episode
    ids, logprobs = completion.token_ids[:limit], completion.logprobs[:limit]
    start = len(e.ids)
    e.append(ids, logprobs, version)
    e.spans.append((start, len(e.ids)))
    e.turns += 1
    e.rewards.append(reward)
    e.terminated_early, e.tokens_saved = True, max(0, limit - len(ids))
    e.finish(env_done=False, truncated=False)


@dataclass
class Turn:
    """A model turn appended to its episode, waiting for the env's answer."""

    episode: Episode
    reply: str
    ids: list[int]
    stopped: bool


def take_turn(episode: Episode, completion: Completion, limit: int, version: int, engine: Engine) -> Turn:
    """Append one model turn's tokens; the env has not seen the reply yet."""
    e, tok = episode, engine.tokenizer
    ids, logprobs = completion.token_ids[:limit], completion.logprobs[:limit]
    stopped = bool(ids) and ids[-1] in engine.stop_ids
    start = len(e.ids)
    versions = getattr(completion, "versions", None)  # per token when the turn was a partial rollout
    e.append(ids, logprobs, version if versions is None else versions[:limit])
    e.spans.append((start, len(e.ids)))
    return Turn(e, _decode(tok, ids[:-1] if stopped else ids), ids, stopped)


def finish_turn(turn: Turn, result: StepResult, version: int, engine: Engine) -> None:
    """Record the env's answer to a turn and append its observation tokens (or end the episode)."""
    e, tok, reply, ids, stopped = turn.episode, engine.tokenizer, turn.reply, turn.ids, turn.stopped
    observations, reward, done, info = result
    e.turns += 1
    e.rewards.append(float(reward))
    e.last_info = info
    e.tool_calls += int(info.get("tool_calls", 0))
    e.valid_tool_calls += int(info.get("valid_tool_calls", 0))
    if info.get("tool_error"):
        e.tool_errors.append(str(info["tool_error"]))
    history = e.messages
    e.messages = [*history, {"role": "assistant", "content": reply}]
    if done:
        e.finish(env_done=True, truncated=not stopped)
        return
    if e.turns >= e.max_turns or e.tokens_left() == 0:
        e.finish(env_done=False, truncated=True)
        return
    stop_text = _decode(tok, ids[-1:]) if stopped else None
    tail, tail_ids = e.renderer.continuation(e.context, history, reply, stop_text, observations)
    left = e.tokens_left()
    if left is not None and len(tail_ids) >= left:  # no room left for the model's next turn
        e.finish(env_done=False, truncated=True)
        return
    e.append(tail_ids, None, version)
    e.context = e.context + reply + (stop_text or "") + tail
    e.messages += observations
    e.states.append(state_key(observations, info))


def advance(episode: Episode, completion: Completion, limit: int, version: int, engine: Engine) -> None:
    """Append one model turn, step the env, and append its observation tokens (or end the episode)."""
    turn = take_turn(episode, completion, limit, version, engine)
    finish_turn(turn, episode.env.step(turn.reply), version, engine)


def step_envs(turns: list[Turn]) -> list[StepResult]:
    """Every turn's env step, in the order of ``turns``. Envs that share a ``batch_scorer`` are stepped in one
    call of it. Steps of envs with ``concurrent_steps`` run in threads, so k tool calls that each wait L seconds
    cost about L, not k x L; each episode has its own env, so the results are the ones the sequential loop
    would get. The others run in the calling thread."""
    results: dict[int, StepResult] = {}
    batches: dict[int, list[Turn]] = {}
    for t in turns:
        if t.episode.env.batch_scorer is not None:
            batches.setdefault(id(t.episode.env.batch_scorer), []).append(t)
    for batch in batches.values():
        scorer = batch[0].episode.env.batch_scorer
        for t, result in zip(batch, scorer.step_many([t.episode.env for t in batch], [t.reply for t in batch]),
                             strict=True):
            results[id(t)] = result
    turns_left = [t for t in turns if id(t) not in results]
    threaded = [t for t in turns_left if t.episode.env.concurrent_steps]
    if len(threaded) < 2:
        results.update({id(t): t.episode.env.step(t.reply) for t in turns_left})
        return [results[id(t)] for t in turns]
    with ThreadPoolExecutor(min(len(threaded), MAX_ENV_THREADS), thread_name_prefix="env-step") as pool:
        futures = {id(t): pool.submit(t.episode.env.step, t.reply) for t in threaded}
        for t in turns_left:
            if id(t) not in futures:
                results[id(t)] = t.episode.env.step(t.reply)
        for t in threaded:
            results[id(t)] = futures[id(t)].result()
    return [results[id(t)] for t in turns]


def advance_all(
    episodes: list[Episode],
    completions: list[Completion],
    limits: list[int],
    version: int,
    engine: Engine,
    stopper: EarlyStopper | None = None,
) -> None:
    """``advance`` for every episode of one turn, their env steps run together (``step_envs``); a completion
    the early-stop predicate cut ends its episode instead. Tokenizer work stays in the calling thread."""
    turns = []
    for e, c, limit in zip(episodes, completions, limits, strict=True):
        if c.stopped and stopper is not None:
            stop_early(e, c, limit, version, stopper.terminal_reward)
        else:
            turns.append(take_turn(e, c, limit, version, engine))
    for turn, result in zip(turns, step_envs(turns), strict=True):
        finish_turn(turn, result, version, engine)


def to_trajectory(e: Episode, tokenizer: PreTrainedTokenizerBase) -> Trajectory:
    total = sum(e.rewards)
    # Evaluation's success measure: the env's own score when it ended the episode, else nothing was solved.
    score = float(e.last_info.get("score", total)) if e.env_done else 0.0
    info: dict[str, Any] = {
        "answer": e.item.get("answer"), "score": score, "turns": e.turns, "env_done": e.env_done,
        "turn_rewards": list(e.rewards), "turn_states": e.states[: e.turns],
    }
    if e.terminated_early:
        info["tokens_saved"] = e.tokens_saved
    if e.env_done and "reward_error" in e.last_info:
        info["reward_error"] = e.last_info["reward_error"]
    if e.env.tools:
        info.update(tool_calls=e.tool_calls, valid_tool_calls=e.valid_tool_calls, tool_errors=e.tool_errors)
    return Trajectory(
        task=e.task.name,
        item_id=e.item_id,
        group_id=e.group_id,
        input_ids=e.ids,
        loss_mask=e.loss_mask,
        logprobs=e.logprobs,
        versions=e.versions,
        turn_spans=e.spans,
        text=_decode(tokenizer, e.ids[e.prompt_len :]),
        rewards={e.task.name: total, **(e.last_info.get("reward_terms") or {} if e.env_done else {})},
        reward=total,
        truncated=e.truncated,
        terminated_early=e.terminated_early,
        info=info,
    )


def greedy(max_new_tokens: int) -> RolloutConfig:
    """The sampling of evaluation: one greedy episode per item. Temperature 0 is outside what a training config
    accepts (it must be > 0), so this config is built without validation."""
    return RolloutConfig.model_construct(group_size=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)


def rollout(
    engine: Engine,
    requests: list[tuple[Task, int, dict[str, Any]]],
    config: RolloutConfig,
    seed: int,
    version: int,
    first_group_id: int = 0,
    stopper: EarlyStopper | None = None,
) -> list[Trajectory]:
    """Play ``config.group_size`` episodes per (task, item_id, item) request, sampled at ``config``'s
    temperature and top-p; ``config.max_new_tokens`` is per model turn.

    Turn limits and token budgets come from each task (``tasks[].max_turns`` / ``max_tokens``, or the env's
    default), so tasks of different kinds can share one batch.
    """
    episodes = play(engine, requests, config, seed, version, first_group_id, stopper)
    return [to_trajectory(e, engine.tokenizer) for e in episodes]


def play(
    engine: Engine,
    requests: list[tuple[Task, int, dict[str, Any]]],
    config: RolloutConfig,
    seed: int,
    version: int,
    first_group_id: int = 0,
    stopper: EarlyStopper | None = None,
) -> list[Episode]:
    """``rollout`` before the conversion to Trajectories: the finished episodes, messages included.

    With a ``stopper``, a turn whose uncertainty spikes ends its episode early (``polyrl.rollout.early_stop``).
    """
    tok = engine.tokenizer
    group_size, max_new_tokens = config.group_size, config.max_new_tokens
    temperature, top_p = config.temperature, config.top_p
    episodes: list[Episode] = []
    for g, (task, item_id, item) in enumerate(requests):
        group = [start_episode(task, item_id, item, first_group_id + g, tok) for _ in range(group_size)]
        if any(e.ids != group[0].ids for e in group):
            raise ValueError(f"task '{task.name}': env reset gave different prompts for one item; it must be "
                             "deterministic in the item")
        episodes += group
    turn = 0
    while active := [e for e in episodes if not e.done]:
        limits = [e.turn_limit(max_new_tokens) for e in active]
        turn_seed = seed + turn * TURN_SEED_STRIDE
        # Output row r of this turn's generate call plays active[r] (both orders are group-major).
        extra = {"stop": stopper.predicate([id(e) for e in active])} if stopper is not None else {}
        if turn == 0:  # every group's samples share one prompt: prefill it once
            groups = engine.generate([episodes[i * group_size].ids for i in range(len(requests))], group_size,
                                     max(limits), temperature, top_p, turn_seed, **extra)
            completions = [c for group in groups for c in group]
        else:
            outs = engine.generate([e.ids for e in active], 1, max(limits), temperature, top_p, turn_seed,
                                   **extra)
            completions = [c for (c,) in outs]
        advance_all(active, completions, limits, version, engine, stopper)
        turn += 1
    return episodes


def evaluate(
    engine: Engine, task: Task, n: int | None, max_new_tokens: int, batch_size: int = 64,
    part: tuple[int, int] = (0, 1),
) -> dict[str, float]:
    """Greedy episodes on the task's held-out items (the same items for every call with the same seed).

    ``accuracy`` counts fully solved episodes (score 1); ``mean_score`` keeps the scorer's partial credit.
    ``part`` (k, parts): only the k-th of ``parts`` contiguous shares of the items (one per learner rank).
    """
    items = task.eval_items(n)
    lo, hi = contiguous_shards(len(items), part[1])[part[0]]
    trajectories: list[Trajectory] = []
    for start in range(lo, hi, batch_size):
        chunk = [(task, start + i, item) for i, item in enumerate(items[start : min(start + batch_size, hi)])]
        trajectories += rollout(engine, chunk, greedy(max_new_tokens), seed=0, version=-1)
    scores = [t.info["score"] for t in trajectories]
    count = max(len(scores), 1)
    return {
        "accuracy": sum(s >= 1.0 for s in scores) / count,
        "solved": sum(s >= 1.0 for s in scores),
        "mean_score": sum(scores) / count,
        "n": len(scores),
        "response_length": sum(t.num_model_tokens for t in trajectories) / count,
        **rollout_metrics(trajectories),
    }


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float | None]:
    """Turn and tool-use statistics: ``turns/mean`` always; for tool envs ``tool_calls/mean``,
    ``valid_tool_call_rate`` (None when no call was attempted) and ``tool_errors/mean``."""
    if not trajectories:
        return {}
    metrics: dict[str, float | None] = {"turns/mean": mean(t.info.get("turns", 1) for t in trajectories)}
    tool = [t for t in trajectories if "tool_calls" in t.info]
    if tool:
        calls = sum(t.info["tool_calls"] for t in tool)
        metrics["tool_calls/mean"] = calls / len(tool)
        valid = sum(t.info["valid_tool_calls"] for t in tool)
        metrics["valid_tool_call_rate"] = valid / calls if calls else None
        metrics["tool_errors/mean"] = mean(len(t.info["tool_errors"]) for t in tool)
    return metrics
