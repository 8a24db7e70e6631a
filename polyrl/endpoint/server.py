"""The OpenAI-compatible endpoint on the policy: FastAPI routes, uvicorn on 127.0.0.1 in a background thread.

``/v1/chat/completions`` answers anyone (``polyrl serve``); ``/episodes/<id>/v1/chat/completions`` answers one
episode of a rollout and records each call's prompt ids, sampled ids and log-probs (``capture``). During
training the sampling settings are the run's (``rollout.temperature``, ``top_p``; the learner's ratios assume
them) and a request's ``max_tokens`` is capped at ``rollout.max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from polyrl.endpoint.batcher import Batcher, Job
from polyrl.endpoint.capture import Call, EpisodeCapture
from polyrl.endpoint.chat import Conversation
from polyrl.endpoint.protocol import RequestError, parse_request
from polyrl.envs.tool_parsers import ToolParser, get_parser

HOST = "127.0.0.1"  # loopback only: the policy is never served beyond this machine
log = logging.getLogger("polyrl.endpoint")


@dataclass
class Sampling:
    """Settings a rollout imposes on its episodes' requests (None: the request's own)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 512
    """The default and the cap of a request's max_tokens."""


@dataclass
class _Episode:
    capture: EpisodeCapture
    conversation: Conversation


class Endpoint:
    """The state behind the routes: the engine's batcher, the served model names and the open episodes."""

    def __init__(self, engine: Any, model_names: Iterable[str], parser: ToolParser | None = None) -> None:
        self.batcher = Batcher(engine)
        self.model_names = set(model_names)
        self.parser = parser or get_parser("auto", engine.tokenizer)
        self.sampling = Sampling()
        self.episodes: dict[str, _Episode] = {}
        limit = getattr(getattr(getattr(engine, "policy", None), "config", None), "max_position_embeddings", None)
        self.context_limit: int | None = limit

    @property
    def tokenizer(self) -> Any:
        return self.batcher.engine.tokenizer

    def open_episode(self, episode_id: str, parser: ToolParser | None = None) -> None:
        self.episodes[episode_id] = _Episode(EpisodeCapture(episode_id),
                                             Conversation(self.tokenizer, parser or self.parser))

    def close_episode(self, episode_id: str) -> EpisodeCapture:
        episode = self.episodes.pop(episode_id)
        episode.capture.open = False
        self.batcher.drop(episode_id)
        return episode.capture

    async def complete(self, body: Any, episode_id: str | None) -> dict[str, Any]:
        episode = None
        if episode_id is not None:
            episode = self.episodes.get(episode_id)
            if episode is None:
                raise RequestError(f"episode '{episode_id}' is not open (finished, timed out or unknown)",
                                   code="episode_not_open")
        try:
            return await self._complete(body, episode)
        except RequestError as exc:
            if episode is not None:
                episode.capture.errors.append(exc.message)
            raise

    async def _complete(self, body: Any, episode: _Episode | None) -> dict[str, Any]:
        request = parse_request(body)
        if request.model not in self.model_names:
            raise RequestError(f"model: unknown model '{request.model}'; this endpoint serves "
                               f"{', '.join(sorted(self.model_names))}", "model", "model_not_found")
        conversation = episode.conversation if episode is not None else Conversation(self.tokenizer, self.parser)
        tools = request.tool_schemas()
        rendered = conversation.render(request.messages, tools)
        s = self.sampling
        max_tokens = min(request.token_limit or s.max_tokens, s.max_tokens)
        if self.context_limit is not None:
            room = self.context_limit - len(rendered.ids)
            if room < 1:
                raise RequestError(f"messages: the prompt is {len(rendered.ids)} tokens; the model's context is "
                                   f"{self.context_limit}", "messages", "context_length_exceeded")
            max_tokens = min(max_tokens, room)
        temperature = s.temperature if s.temperature is not None else request.temperature
        top_p = s.top_p if s.top_p is not None else request.top_p
        job = Job(rendered.ids, request.n, max_tokens, 1.0 if temperature is None else temperature,
                  1.0 if top_p is None else top_p, request.stops, asyncio.get_running_loop().create_future(),
                  owner=episode.capture.episode_id if episode is not None else None)
        samples = await self.batcher.submit(job)
        if episode is not None and episode.capture.open:
            episode.capture.calls.append(Call(rendered.ids, samples))
        conversation.turns.append((rendered, samples))
        parse_tools = bool(tools) and request.tool_choice != "none"
        choices = []
        for i, sample in enumerate(samples):
            message, finish = conversation.reply(sample, parse_tools)
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if request.logprobs:
                n = len(sample.token_ids) - int(sample.eos)
                choice["logprobs"] = {"content": [
                    {"token": (t := self.tokenizer.decode([tid], skip_special_tokens=False)), "logprob": lp,
                     "bytes": list(t.encode()), "top_logprobs": []}
                    for tid, lp in zip(sample.token_ids[:n], sample.logprobs[:n], strict=True)]}
            choices.append(choice)
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": choices,
            "usage": {"prompt_tokens": len(rendered.ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(rendered.ids) + completion_tokens},
        }


def build_app(endpoint: Endpoint) -> FastAPI:
    app = FastAPI(title="polyrl policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _unreadable(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(RequestError("the request body is not valid JSON").body(), status_code=400)

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "polyrl"}
                                           for name in sorted(endpoint.model_names)]}

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return await endpoint.complete(await body_of(request), None)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat(episode_id: str, request: Request) -> dict[str, Any]:
        return await endpoint.complete(await body_of(request), episode_id)

    app.get("/v1/models")(models)
    app.get("/episodes/{episode_id}/v1/models")(models)
    return app


class EndpointServer:
    """uvicorn serving ``build_app(endpoint)`` on 127.0.0.1 from a daemon thread with its own event loop."""

    def __init__(self, endpoint: Endpoint, port: int = 0) -> None:
        self.endpoint = endpoint
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((HOST, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(endpoint), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def episode_url(self, episode_id: str) -> str:
        return f"http://{HOST}:{self.port}/episodes/{episode_id}/v1"

    def start(self) -> EndpointServer:
        self._thread = threading.Thread(target=self._serve, name="polyrl-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {HOST}:{self.port}")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted (``polyrl serve``)."""
        self._serve()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` in the server's loop (episode bookkeeping touches the batcher's futures)."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def wait_idle(self, timeout_s: float = 600.0) -> None:
        """Wait until no batch runs and none is queued: the engine is free (for a weight update)."""
        deadline = time.monotonic() + timeout_s
        while not self.call(lambda: self.endpoint.batcher.idle):
            if time.monotonic() > deadline:
                raise RuntimeError("the endpoint's engine did not become idle")
            time.sleep(0.005)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
