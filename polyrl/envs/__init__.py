"""Environments: the reset/step protocol, tools from Python functions, tool-call parsers and built-in envs.

Importing this package registers the built-in envs (reasoning_gym, tool_math, retrieval_qa, frozen_lake,
gym, humaneval, instruct, textarena, dataset, verifiers) and agent tasks (``tasks[].agent``); ``make_task`` builds the
task a config entry names.
"""

from polyrl.envs import (  # noqa: F401
    agent,
    dataset,
    gym_text,
    humaneval,
    instruct,
    reasoning_gym,
    retrieval,
    textarena_env,
    tool_math,
    verifiers_env,
)
from polyrl.envs.base import (
    ENVS,
    Env,
    Message,
    SingleTurnEnv,
    StepResult,
    Task,
    TaskContext,
    check_task,
    env_names,
    make_task,
    register_env,
)
from polyrl.envs.tool_env import ToolEnv
from polyrl.envs.tool_parsers import PARSERS, Parsed, ToolCall, ToolParser, get_parser
from polyrl.envs.tools import Tool, ToolError

__all__ = [
    "ENVS",
    "PARSERS",
    "Env",
    "Message",
    "Parsed",
    "SingleTurnEnv",
    "StepResult",
    "Task",
    "TaskContext",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolParser",
    "check_task",
    "env_names",
    "get_parser",
    "make_task",
    "register_env",
]
