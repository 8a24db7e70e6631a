"""Agent episodes: each runs the user's ``async def run(client, item)`` against its own base URL on the policy's
endpoint; its calls become trajectories sharing the reward it returns.

Episodes run concurrently, each in its own thread and event loop, so an agent that blocks (``time.sleep`` in
async code) holds up only itself; one that outlives ``tasks[].timeout_s`` is abandoned. An episode is dropped,
with its reason logged and counted, when the agent raises, times out, never calls the model, sends a request
the endpoint refuses, or returns something that is not a finite number; its group trains on the rest.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import numbers
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai

from polyrl.config import RolloutConfig
from polyrl.endpoint.capture import EpisodeCapture, to_trajectories
from polyrl.endpoint.server import Endpoint, EndpointServer, Sampling
from polyrl.envs.agent import AgentTask
from polyrl.envs.tool_parsers import get_parser
from polyrl.types import Trajectory

log = logging.getLogger("polyrl.endpoint")
GRACE_S = 5.0
"""How long past its timeout an episode's thread may take to notice the cancellation."""
DROP_KINDS = ("raised", "timeout", "no_calls", "bad_request", "bad_reward")

_server: EndpointServer | None = None
_server_lock = threading.Lock()


def shared_server(engine: Any, model_name: str) -> EndpointServer:
    """This process's endpoint (started on first use), now serving ``engine`` as ``model_name``."""
    global _server
    with _server_lock:
        if _server is None:
            _server = EndpointServer(Endpoint(engine, [model_name, "policy"])).start()
        else:
            _server.wait_idle()
            endpoint = _server.endpoint
            if endpoint.batcher.engine is not engine:
                endpoint.batcher.engine = engine
            endpoint.model_names = {model_name, "policy"}
        return _server


@dataclass
class Outcome:
    """What became of one episode."""

    trajectories: list[Trajectory] = field(default_factory=list)
    dropped: str | None = None
    """The drop kind (one of DROP_KINDS), None when kept."""
    reason: str = ""
    score: float = 0.0


def _reward(result: Any) -> tuple[float, dict[str, Any]]:
    reward, info = result, {}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        reward, info = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"returned {type(reward).__name__}, not a number (or (reward, info))")
    if not math.isfinite(float(reward)):
        raise TypeError(f"returned a reward of {reward}")
    return float(reward), info


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One context for every client: the endpoint is plain http on loopback, but an httpx client builds a
    TLS context (loading the CA bundle, ~50 ms of CPU) unless it is given one."""
    return ssl.create_default_context()


def _play(task: AgentTask, url: str, item: dict[str, Any], out: dict[str, Any]) -> None:
    timeout = task.config.timeout_s

    async def main() -> Any:
        http = openai.DefaultAsyncHttpxClient(verify=_tls_context())
        async with openai.AsyncOpenAI(base_url=url, api_key="polyrl", max_retries=0, timeout=timeout,
                                      http_client=http) as client:
            return await asyncio.wait_for(task.agent(client, item), timeout)

    try:
        out["result"] = asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - whatever the agent raises drops its episode, nothing else
        out["error"] = exc


def run_episodes(
    server: EndpointServer,
    episodes: list[tuple[AgentTask, int, dict[str, Any], int]],
    sampling: Sampling,
    seed: int,
    version: int,
) -> list[Outcome]:
    """Play (task, item_id, item, group_id) episodes concurrently; one Outcome each, in order."""
    endpoint = server.endpoint
    ids = [uuid.uuid4().hex for _ in episodes]
    parsers = {}
    for (task, *_), eid in zip(episodes, ids, strict=True):
        parser = parsers.setdefault(task.name, get_parser(task.config.tool_parser, endpoint.tokenizer))
        server.call(endpoint.open_episode, eid, parser)
    results: list[dict[str, Any]] = [{} for _ in episodes]
    threads = [threading.Thread(target=_play, args=(task, server.episode_url(eid), item, out), daemon=True,
                                name=f"agent-{task.name}-{item_id}")
               for (task, item_id, item, _), eid, out in zip(episodes, ids, results, strict=True)]
    # A batch need not wait for company once every episode still running has a request queued.
    endpoint.sampling, endpoint.batcher.seed = sampling, seed
    endpoint.batcher.expected = lambda: sum(t.is_alive() for t in threads)
    start = time.monotonic()
    for t in threads:
        t.start()
    for t, (task, *_) in zip(threads, episodes, strict=True):
        t.join(max(0.0, start + task.config.timeout_s + GRACE_S - time.monotonic()))
    abandoned = [t.is_alive() for t in threads]  # before closing: an episode ends in time or it does not count
    captures = [server.call(endpoint.close_episode, eid) for eid in ids]
    endpoint.batcher.expected = None
    server.wait_idle()  # calls of abandoned episodes finish before the caller updates the weights
    return [_outcome(task, item_id, item, gid, cap, dict(out), alive, version, endpoint.tokenizer)
            for (task, item_id, item, gid), cap, out, alive in zip(episodes, captures, results, abandoned,
                                                                      strict=True)]


def _outcome(task: AgentTask, item_id: int, item: dict[str, Any], group_id: int, capture: EpisodeCapture,
             out: dict[str, Any], alive: bool, version: int, tokenizer: Any) -> Outcome:
    error = out.get("error")
    kind, reason = None, ""
    if alive or isinstance(error, asyncio.TimeoutError | TimeoutError):
        kind, reason = "timeout", f"ran past its timeout of {task.config.timeout_s:g} s"
    elif capture.errors:
        kind, reason = "bad_request", f"sent a request the endpoint refused: {capture.errors[0]}"
    elif error is not None:
        kind, reason = "raised", f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    elif not capture.calls:
        kind, reason = "no_calls", "never called the model"
    else:
        try:
            reward, info = _reward(out.get("result"))
        except TypeError as exc:
            kind, reason = "bad_reward", str(exc)
    if kind is not None:
        log.warning("task '%s' item %s: episode dropped: the agent %s", task.name, item_id, reason)
        return Outcome(dropped=kind, reason=reason)
    score = float(info.get("score", reward)) if isinstance(info.get("score", reward), numbers.Real) else reward
    meta = {"answer": item.get("answer"), "score": score, "env_done": True, "agent": True,
            "turn_rewards": [reward], "agent_info": {k: v for k, v in info.items() if k != "score"}}
    return Outcome(to_trajectories(capture, task.name, item_id, group_id, reward, version, meta, tokenizer),
                   score=score)


def agent_rollout(
    engine: Any, model_name: str, requests: list[tuple[AgentTask, int, dict[str, Any], int]],
    config: RolloutConfig, seed: int, version: int,
) -> tuple[list[Trajectory], dict[str, float]]:
    """``config.group_size`` episodes per (task, item_id, item, group_id) request, sampled as ``config`` says;
    the trajectories of the kept episodes and the step's metrics: drops by kind, calls merged into and split
    from trajectories."""
    server = shared_server(engine, model_name)
    episodes = [(task, item_id, item, gid) for task, item_id, item, gid in requests
                for _ in range(config.group_size)]
    sampling = Sampling(config.temperature, config.top_p, config.max_new_tokens)
    outcomes = run_episodes(server, episodes, sampling, seed, version)
    trajectories = [t for o in outcomes for t in o.trajectories]
    return trajectories, capture_metrics(outcomes)


def capture_metrics(outcomes: list[Outcome]) -> dict[str, float]:
    kept = [o for o in outcomes if o.dropped is None]
    metrics = {"agent/episodes": float(len(outcomes)), "agent/dropped": float(len(outcomes) - len(kept))}
    metrics.update({f"agent/dropped/{k}": float(sum(o.dropped == k for o in outcomes)) for k in DROP_KINDS})
    firsts = [o.trajectories[0].info for o in kept]
    metrics["agent/merged_calls"] = float(sum(i["merged_calls"] for i in firsts))
    metrics["agent/split_calls"] = float(sum(i["split_calls"] for i in firsts))
    metrics["agent/resampled"] = float(sum(i["resampled"] for i in firsts))
    return metrics


def evaluate_agent(engine: Any, model_name: str, task: AgentTask, n: int | None, max_new_tokens: int,
                   batch_size: int = 64) -> dict[str, float]:
    """Greedy episodes on the task's held-out items; a dropped episode counts as unsolved."""
    items = task.eval_items(n)
    server = shared_server(engine, model_name)
    outcomes: list[Outcome] = []
    for lo in range(0, len(items), batch_size):
        chunk = [(task, lo + i, item, lo + i) for i, item in enumerate(items[lo : lo + batch_size])]
        outcomes += run_episodes(server, chunk, Sampling(0.0, 1.0, max_new_tokens), seed=0, version=-1)
    count = max(len(outcomes), 1)
    solved = sum(o.score >= 1.0 for o in outcomes if o.dropped is None)
    tokens = sum(t.num_model_tokens for o in outcomes for t in o.trajectories)
    return {"accuracy": solved / count, "solved": solved, "n": len(outcomes),
            "mean_score": sum(o.score for o in outcomes) / count, "response_length": tokens / count,
            "dropped": sum(o.dropped is not None for o in outcomes)}
