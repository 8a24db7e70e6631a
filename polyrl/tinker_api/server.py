"""The Tinker API's HTTP routes (FastAPI), served by uvicorn on 127.0.0.1 from a thread of its own.

Requests are read with the SDK's own request types (``tinker.types``), so a field the SDK would not send is an
error naming it. Work is answered with a future the client polls at ``/api/v1/retrieve_future``; a poll waits
up to ``POLL_SECONDS`` for the result before answering "try again". What a local server has no use for
(API keys, projects, telemetry, session heartbeats) is accepted and ignored; any other route answers 404 with
the call it names.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from tinker import types

from polyrl.tinker_api import wire
from polyrl.tinker_api.service import Service
from polyrl.tinker_api.wire import Unknown, WireError

HOST = "127.0.0.1"  # loopback only: the model is never served beyond this machine
POLL_SECONDS = 30.0  # the SDK gives up on a poll after 45 s
KEEP_RETRIEVED_SECONDS = 120.0
log = logging.getLogger("polyrl.tinker")

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # any API key is accepted as it is; none is checked
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "detail": message}, status_code=status)


async def _read(request: Request, model: type[BaseModel], call: str) -> Any:
    """The JSON body checked against the SDK's request type; a WireError naming the call and field if not."""
    try:
        body = await request.json()
    except ValueError:
        raise WireError(f"{call}: the body is not JSON") from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise WireError(f"{call}: {where}: {first['msg']}") from None


async def _json_or_none(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


def _dump(model: BaseModel | None) -> dict[str, Any] | None:
    return None if model is None else model.model_dump(mode="json")


def _future_result(future: Any) -> Response:
    exc = future.exception()
    if exc is not None:
        category = "user" if isinstance(exc, WireError) else "server"
        message = str(exc) if isinstance(exc, WireError) else f"{type(exc).__name__}: {exc}"
        return JSONResponse({"error": message, "category": category})
    result = future.result()
    if isinstance(result, bytes):
        return Response(result, media_type=wire.PROTO)
    return JSONResponse(result)


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="polyrl Tinker API", docs_url=None, redoc_url=None, openapi_url=None)

    def route(path: str, call: Callable, method: str = "POST", request_type: type[BaseModel] | None = None):
        """``call(request, body)`` answering JSON, ``body`` the request read as ``request_type``; WireError is
        the caller's mistake (400), Unknown an id the server does not know (404)."""

        async def handler(request: Request) -> Response:
            name = next(part for part in reversed(path.split("/")) if not part.startswith("{"))
            try:
                body = await _read(request, request_type, name) if request_type is not None else None
                result = call(request, body)
                if asyncio.iscoroutine(result):
                    result = await result
            except WireError as exc:
                service.skip(await _json_or_none(request))
                return _error(400, str(exc))
            except Unknown as exc:
                service.skip(await _json_or_none(request))
                return _error(404, f"{name}: {exc}")
            return result if isinstance(result, Response) else JSONResponse(result)

        app.add_api_route(path, handler, methods=[method])

    route("/api/v1/healthz", lambda r, b: {"status": "ok"}, "GET")
    route("/api/v1/get_server_capabilities", lambda r, b: service.capabilities(), "GET")
    route("/api/v1/client/config", lambda r, b: CLIENT_CONFIG)
    route("/api/v1/client/dynamic_config", lambda r, b: {"sample_cancel_enabled": False})
    route("/api/v1/create_session", lambda r, b: service.create_session(), request_type=types.CreateSessionRequest)
    route("/api/v1/session_heartbeat", lambda r, b: {"type": "session_heartbeat"})
    route("/api/v1/sessions/{session_id}/finish", lambda r, b: Response(status_code=200))
    route("/api/v1/telemetry", lambda r, b: {"status": "accepted"})
    route("/api/v1/create_model", lambda r, b: service.create_model(
        b.session_id, b.model_seq_id, b.base_model, _dump(b.lora_config), _dump(b.optimizer_config)),
        request_type=types.CreateModelRequest)
    route("/api/v1/get_info", lambda r, b: service.info(b.model_id), request_type=types.GetInfoRequest)
    route("/api/v1/optim_step", lambda r, b: service.optim_step(b.model_id, b.seq_id, _dump(b.optim_params)),
          request_type=types.OptimStepRequest)
    route("/api/v1/save_weights", lambda r, b: service.save(
        b.model_id, b.seq_id, b.path, "weights", b.overwrite, b.user_metadata), request_type=types.SaveWeightsRequest)
    route("/api/v1/save_weights_for_sampler", lambda r, b: service.save(
        b.model_id, b.seq_id, b.path, "sampler_weights", True, b.user_metadata),
        request_type=types.SaveWeightsForSamplerRequest)
    route("/api/v1/load_weights", lambda r, b: service.load(_dump(b)), request_type=types.LoadWeightsRequest)
    route("/api/v1/create_sampling_session", lambda r, b: service.create_sampling_session(b.base_model, b.model_path),
          request_type=types.CreateSamplingSessionRequest)
    route("/api/v1/samplers/{sampler_id}", lambda r, b: service.sampler_info(r.path_params["sampler_id"]), "GET")
    route("/api/v1/asample", lambda r, b: service.sample(_dump(b)), request_type=types.SampleRequest)
    route("/api/v1/training_runs/{model_id}", lambda r, b: service.training_run(r.path_params["model_id"]), "GET")
    route("/api/v1/training_runs/{model_id}/checkpoints",
          lambda r, b: service.checkpoints(r.path_params["model_id"]), "GET")
    route("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}", lambda r, b: (
        service.delete_checkpoint(r.path_params["model_id"], r.path_params["checkpoint_id"]),
        Response(status_code=200))[1], "DELETE")

    async def forward_backward(request: Request, body: None) -> dict[str, Any]:
        if request.headers.get("content-encoding"):
            raise WireError("forward_backward: compressed bodies are not accepted (the server's client config "
                            "turns compression off)")
        return service.forward_backward(wire.read_forward_backward(await request.body()))

    route("/api/v1/forward_backward", forward_backward)

    async def retrieve(request: Request, body: dict[str, Any]) -> Response:
        request_id = body.request_id
        future = service.future(request_id)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except Exception:  # noqa: BLE001, S110 - the future's own exception is answered below
            pass
        asyncio.get_running_loop().call_later(KEEP_RETRIEVED_SECONDS, service.forget, request_id)
        return _future_result(future)

    route("/api/v1/retrieve_future", retrieve, request_type=types.FutureRetrieveRequest)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unimplemented(request: Request, path: str) -> JSONResponse:
        call = path.removeprefix("api/v1/") or "/"
        service.skip(await _json_or_none(request))
        return _error(404, f"polyrl's Tinker server does not implement '{call}' ({request.method} /{path})")

    return app


class TinkerServer:
    """uvicorn serving ``build_app(service)`` on 127.0.0.1:``port`` (0 picks a free port)."""

    def __init__(self, service: Service, port: int = 0) -> None:
        self.service = service
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((HOST, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(service), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> TinkerServer:
        self._thread = threading.Thread(target=self.serve_forever, name="polyrl-tinker", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the Tinker server did not start on {HOST}:{self.port}")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
