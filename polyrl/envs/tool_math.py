"""Tool math: reasoning-gym arithmetic problems with a ``calculate`` tool.

The calculator walks the expression's ``ast`` and accepts only numbers, + - * / ** and parentheses, with
limits on length, nesting, exponents and magnitudes, so no model output can run code or exhaust memory.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Env, Message, Task, TaskContext, register_env
from polyrl.envs.reasoning_gym import ReasoningGymTask, check_task_name, extract_answer, score_answer
from polyrl.envs.tool_env import ToolEnv
from polyrl.envs.tool_parsers import ToolCall, ToolParser

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 30
MAX_ABS = 1e100
MAX_EXPONENT = 100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Symbols models write for arithmetic that Python spells differently.
_SPELLINGS = {"×": "*", "÷": "/", "−": "-", "^": "**"}


def _check_size(value: int | float) -> int | float:
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_ABS:
        raise ValueError("result is too large")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise ValueError(f"exponent {exp} is too large (at most {MAX_EXPONENT})")
    # Bound the size before computing: |base| ** exp must stay under MAX_ABS.
    if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) > math.log10(MAX_ABS):
        raise ValueError("result is too large")
    if base == 0 and exp < 0:
        raise ValueError("zero cannot be raised to a negative power")
    result = base**exp
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power is not a real number")
    return result


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise ValueError("expression is nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ValueError("division by zero")
            if isinstance(left, int) and isinstance(right, int) and left % right == 0:
                return left // right  # exact integer division stays an int, so 6/3 prints as 2
        return _check_size(_BINARY[type(node.op)](left, right))
    raise ValueError("only numbers, + - * / ** and parentheses are allowed")


def safe_eval(expression: str) -> int | float:
    """Evaluate arithmetic without ``eval``; raise ValueError with a message fit to show the model."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().rstrip("=?").strip()
    for symbol, python in _SPELLINGS.items():
        text = text.replace(symbol, python)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body, 0)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / ** and parentheses, for example "(12 + 7) * 3".
    """
    return format_number(safe_eval(expression))


INSTRUCTIONS = (
    "Solve the arithmetic problem. You can use the calculate tool to evaluate expressions. "
    "When you know the result, reply with just the final number and no tool call."
)


class ToolMathEnv(ToolEnv):
    """One arithmetic problem; the model may call ``calculate``; its final reply's number is scored."""

    def __init__(
        self,
        task: ReasoningGymTask,
        tool_parser: ToolParser | None = None,
        tool_error_penalty: float = 0.0,
        max_calls_per_turn: int = 4,
    ) -> None:
        super().__init__([calculate], tool_parser, tool_error_penalty, max_calls_per_turn)
        self.task = task
        self.item: dict[str, Any] = {}

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.item = item
        prefix = self.task.system_prompt
        system = f"{prefix}\n\n{INSTRUCTIONS}" if prefix else INSTRUCTIONS
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": item["question"] + self.task.config.prompt_suffix},
        ]

    def score(self, answer: str) -> float:
        return score_answer(self.task.train, self.item, extract_answer(self.task.config, answer))

    def demonstration(self, item: dict[str, Any]) -> list[str] | None:
        """The assistant replies of a solved episode, for SFT warm starts (``polyrl.train.demonstrations``):
        one calculate call on the item's expression in this env's tool-call format, then the result alone.
        None when the item carries no expression (reasoning-gym puts it in ``metadata.expression``)."""
        expression = item.get("metadata", {}).get("expression")
        if not isinstance(expression, str):
            return None
        call = self.tool_parser.format_calls([ToolCall("calculate", {"expression": expression})])
        return [call, calculate(expression)]


class ToolMathParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = "basic_arithmetic"
    """A reasoning-gym arithmetic dataset: basic_arithmetic, chain_sum, products, ..."""
    dataset_params: dict[str, Any] = {}
    """Passed to the dataset constructor (difficulty)."""
    tool_error_penalty: float = Field(0.0, ge=0)
    """Reward subtracted for each turn with a malformed call, an unknown tool or a failing tool."""
    max_calls_per_turn: int = Field(4, gt=0)


class ToolMathTask(ReasoningGymTask):
    def __init__(self, config: TaskConfig, ctx: TaskContext) -> None:
        self.params: ToolMathParams = ctx.params
        self.tool_parser = ctx.tool_parser
        super().__init__(config, ctx.seed, ctx.system_prompt, self.params.dataset, self.params.dataset_params)

    def _env(self) -> Env:
        p = self.params
        return ToolMathEnv(self, self.tool_parser, p.tool_error_penalty, p.max_calls_per_turn)


def _check(config: TaskConfig, key: str) -> None:
    check_task_name(ToolMathParams.model_validate(config.params).dataset, key=f"{key}.params.dataset")


@register_env("tool_math", params=ToolMathParams, check=_check)
def tool_math_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Arithmetic problems from reasoning-gym with a calculate tool."""
    return ToolMathTask(config, ctx)
