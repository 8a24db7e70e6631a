"""The OpenAI-compatible endpoint on the policy: FastAPI routes, uvicorn on 127.0.0.1 in a background thread.

``/v1/chat/completions`` answers anyone (``polyrl serve``); ``/episodes/<id>/v1/chat/completions`` answers one
episode of a rollout and records each call's prompt ids, sampled ids and log-probs (``capture``). During
training the sampling settings are the run's (``rollout.temperature``, ``top_p``; the learner's ratios assume
them) and a request's ``max_tokens`` is capped at ``rollout.max_new_tokens``.

``stream: true`` is answered with server-sent events (``stream``). A client that closes its connection before
its answer is complete has its request cancelled: taken from the queue, or its rows ended at the running
batch's next decoding step; nothing of it is recorded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polyrl.endpoint.batcher import Batcher, Job
from polyrl.endpoint.capture import Call, EpisodeCapture
from polyrl.endpoint.chat import Conversation, Rendered, Sample
from polyrl.endpoint.protocol import ChatRequest, RequestError, parse_request
from polyrl.endpoint.stream import TextStream, chunks, token_logprob
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


@dataclass
class Prepared:
    """A request read, rendered and checked, ready to sample: everything a bad request can fail on is behind."""

    request: ChatRequest
    conversation: Conversation
    rendered: Rendered
    episode: _Episode | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


class Endpoint:
    """The state behind the routes: the engine's batcher, the served model names and the open episodes."""

    tool_choice_tries = 3
    """Samples a choice may take to make the call ``tool_choice`` asks for (``required`` or a named function)."""

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

    async def completion(self, p: Prepared) -> dict[str, Any]:
        """A non-streamed chat completion."""
        choices, usage = self.respond(p, await self.sample(p))
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": p.request.model, "choices": choices, "usage": usage}

    def prepare(self, body: Any, episode_id: str | None) -> Prepared:
        """Read, render and check a request; a RequestError (recorded against its episode) if it is bad."""
        episode = None
        if episode_id is not None:
            episode = self.episodes.get(episode_id)
            if episode is None:
                raise RequestError(f"episode '{episode_id}' is not open (finished, timed out or unknown)",
                                   code="episode_not_open")
        try:
            return self._prepare(body, episode)
        except RequestError as exc:
            if episode is not None:
                episode.capture.errors.append(exc.message)
            raise

    def _prepare(self, body: Any, episode: _Episode | None) -> Prepared:
        request = parse_request(body)
        if request.model not in self.model_names:
            raise RequestError(f"model: unknown model '{request.model}'; this endpoint serves "
                               f"{', '.join(sorted(self.model_names))}", "model", "model_not_found")
        conversation = episode.conversation if episode is not None else Conversation(self.tokenizer, self.parser)
        rendered = conversation.render(request.messages, request.tool_schemas())
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
        # An episode's calls are sampled as the run seeds them (train.seed): a request's own seed would run
        # each call alone and unbatched.
        seed = request.seed if episode is None else None
        return Prepared(request, conversation, rendered, episode, max_tokens,
                        1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p, seed)

    def _job(self, p: Prepared, n: int, attempt: int, tokens: asyncio.Queue | None = None) -> Job:
        return Job(p.rendered.ids, n, p.max_tokens, p.temperature, p.top_p, p.request.stops,
                   asyncio.get_running_loop().create_future(),
                   owner=p.episode.capture.episode_id if p.episode is not None else None,
                   seed=None if p.seed is None else p.seed + attempt, tokens=tokens,
                   top_logprobs=p.request.top_logprobs or 0)

    async def sample(self, p: Prepared, tokens: asyncio.Queue | None = None) -> list[Sample]:
        """The request's samples, each making the call ``tool_choice`` asks for when it could within
        ``tool_choice_tries`` samples (the last one otherwise); recorded in its episode."""
        samples = await self.batcher.submit(self._job(p, p.request.n, 0, tokens))
        wanted = p.request.required_call
        for attempt in range(1, self.tool_choice_tries if wanted is not None else 1):
            missing = [i for i, sample in enumerate(samples) if not self._makes_call(p, sample, wanted)]
            if not missing:
                break
            if p.episode is not None:
                p.episode.capture.resampled += len(missing)
            again = await self.batcher.submit(self._job(p, len(missing), attempt))
            for i, sample in zip(missing, again, strict=True):
                samples[i] = sample
        if p.episode is not None and p.episode.capture.open:
            p.episode.capture.calls.append(Call(p.rendered.ids, samples))
        p.conversation.turns.append((p.rendered, samples))
        return samples

    @staticmethod
    def _makes_call(p: Prepared, sample: Sample, wanted: str) -> bool:
        calls = p.conversation.calls(sample)
        return bool(calls) and (not wanted or all(c.name == wanted for c in calls))

    def respond(self, p: Prepared, samples: list[Sample]) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """The choices of a response and its usage."""
        choices = []
        for i, sample in enumerate(samples):
            message, finish = p.conversation.reply(sample, p.request.parses_tools)
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if p.request.logprobs:
                n = len(sample.token_ids) - int(sample.eos)
                steps = zip(sample.token_ids[:n], sample.logprobs[:n], (sample.top_logprobs or [None] * n)[:n],
                            strict=True)
                choice["logprobs"] = {"content": [token_logprob(self.tokenizer, *step) for step in steps]}
            choices.append(choice)
        prompt, completion = len(p.rendered.ids), sum(len(s.token_ids) for s in samples)
        return choices, {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}

    def stream(self, p: Prepared) -> AsyncIterator[str]:
        """The events of a streamed completion; closing them early (a client gone) cancels its sampling."""
        follow = not p.request.parses_tools and not p.request.top_logprobs  # or they come whole (stream.py)
        tokens: asyncio.Queue | None = asyncio.Queue() if follow else None

        async def finish() -> tuple[list[dict[str, Any]], dict[str, int]]:
            return self.respond(p, await self.sample(p, tokens))

        async def events() -> AsyncIterator[str]:
            task = asyncio.ensure_future(finish())
            streams = [TextStream(self.tokenizer, set(self.batcher.engine.stop_ids), p.request.stops)
                       for _ in range(p.request.n)] if follow else None
            logprobs = functools.partial(token_logprob, self.tokenizer) if p.request.logprobs else None
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": p.request.model}
            try:
                async for event in chunks(head, p.request.n, tokens, streams, logprobs, task,
                                          p.request.include_usage):
                    yield event
            finally:
                task.cancel()  # done already unless the client went away

        return events()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the request's body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> Response | dict[str, Any]:
    """``work``'s result; cancelled, its sampling with it, if the client goes away first."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    task.cancel()
    return Response(status_code=499)  # nobody reads it: the client has gone (or its episode was closed)


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

    async def chat(request: Request, episode_id: str | None) -> Any:
        prepared = endpoint.prepare(await body_of(request), episode_id)
        if prepared.request.stream:
            return StreamingResponse(endpoint.stream(prepared), media_type="text/event-stream")
        return await _unless_disconnected(request, endpoint.completion(prepared))

    @app.post("/v1/chat/completions")
    async def anonymous_chat(request: Request) -> Any:
        return await chat(request, None)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat(episode_id: str, request: Request) -> Any:
        return await chat(request, episode_id)

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
        # Listening from here on: a client given base_url before uvicorn starts waits in the backlog instead of
        # being refused (``polyrl serve`` prints the address first).
        self._sock.listen(2048)
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
