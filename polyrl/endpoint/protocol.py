"""The OpenAI chat-completions request as the endpoint reads it, and OpenAI-style errors.

Fields the endpoint does not act on (``user``, ``metadata``, ``parallel_tool_calls``, penalties, ...) are
accepted and ignored, as clients such as the Agents SDK send them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RequestError(Exception):
    """A bad request: answered with status 400 and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    @property
    def parses_tools(self) -> bool:
        """Whether replies are read for tool calls (tools given and ``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def required_call(self) -> str | None:
        """What a reply must call: ``""`` any tool (``required``), a name (a named function), None nothing."""
        if self.tool_choice == "required":
            return ""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


def parse_request(body: Any) -> ChatRequest:
    """Validate a request body; any problem is a RequestError naming the parameter."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = "is required" if first["type"] == "missing" else first["msg"]
        raise RequestError(f"{param}: {msg}" if param else msg, param) from None
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options: only allowed with stream: true", "stream_options")
    if request.top_logprobs and not request.logprobs:
        raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
    if len(request.stops) > 4 or any(not s for s in request.stops):
        raise RequestError("stop: up to 4 non-empty strings", "stop")
    _check_tools(request)
    return request


def _check_tools(request: ChatRequest) -> None:
    names = []
    for i, tool in enumerate(request.tools or []):
        fn = tool.function
        if not _TOOL_NAME.match(fn.name):
            raise RequestError(f"tools[{i}].function.name: '{fn.name}' must be 1-64 letters, digits, _ or -",
                               f"tools[{i}].function.name")
        if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
            raise RequestError(f"tools[{i}].function.parameters: the schema must be of type 'object'",
                               f"tools[{i}].function.parameters")
        if fn.parameters is not None and not isinstance(fn.parameters.get("properties", {}), dict):
            raise RequestError(f"tools[{i}].function.parameters.properties: must be an object",
                               f"tools[{i}].function.parameters")
        names.append(fn.name)
    if len(set(names)) != len(names):
        raise RequestError("tools: two tools share a name", "tools")
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required":
        if not names:
            raise RequestError("tool_choice: 'required' needs tools", "tool_choice")
        return
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name is None:
            raise RequestError("tool_choice: expected {'type': 'function', 'function': {'name': ...}}",
                               "tool_choice")
        if name not in names:
            raise RequestError(f"tool_choice: no tool named '{name}' in tools", "tool_choice")
        return
    raise RequestError(f"tool_choice: '{choice}' is not none, auto, required or a function", "tool_choice")
