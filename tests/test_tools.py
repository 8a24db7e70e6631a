"""Tools from typed Python functions, tool-call parsers, the safe calculator, ToolEnv's error handling."""

import json

import pytest

from polyrl.envs.base import Message
from polyrl.envs.tool_env import ToolEnv
from polyrl.envs.tool_math import calculate, safe_eval
from polyrl.envs.tool_parsers import (
    HermesParser,
    Llama3Parser,
    SmolLM2Parser,
    ToolCall,
    detect_parser,
    get_parser,
)
from polyrl.envs.tools import MAX_RESULT_CHARS, Tool, ToolError


def lookup(city: str, year: int = 2020, metric: bool = True) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        year: Which year.
        metric: Whether to use metric units.
    """
    if city == "boom":
        raise RuntimeError("sensor offline")
    return f"{city} {year} {'C' if metric else 'F'}"


def test_schema_comes_from_signature_and_docstring():
    tool = Tool.from_function(lookup)
    assert tool.name == "lookup"
    fn = tool.schema["function"]
    assert fn["description"] == "Look up the weather of a city."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["year"]["type"] == "integer" and props["metric"]["type"] == "boolean"
    assert fn["parameters"]["required"] == ["city"]


def test_a_function_without_arg_docs_is_a_clear_error():
    def bare(x: int) -> int:
        """No args section."""
        return x

    with pytest.raises(ValueError, match="tool 'bare': cannot build its JSON schema"):
        Tool.from_function(bare)


def test_tool_checks_arguments_before_calling():
    tool = Tool.from_function(lookup)
    assert tool({"city": "Oslo", "year": 1999}) == "Oslo 1999 C"
    with pytest.raises(ToolError, match="missing a required argument: 'city'"):
        tool({})
    with pytest.raises(ToolError, match="unexpected keyword argument 'town'"):
        tool({"city": "Oslo", "town": "x"})
    with pytest.raises(ToolError, match="'year' must be int"):
        tool({"city": "Oslo", "year": "1999"})
    with pytest.raises(ToolError, match="'year' must be int"):
        tool({"city": "Oslo", "year": True})  # JSON true is not a number
    with pytest.raises(ToolError, match="lookup failed: sensor offline"):
        tool({"city": "boom"})


def test_long_results_are_cut():
    def big(n: int) -> str:
        """Big.

        Args:
            n: Length.
        """
        return "x" * n

    out = Tool.from_function(big)({"n": 10 * MAX_RESULT_CHARS})
    assert len(out) < MAX_RESULT_CHARS + 20 and out.endswith("[truncated]")


@pytest.mark.parametrize("parser", [SmolLM2Parser(), HermesParser(), Llama3Parser()])
def test_each_parser_reads_what_it_writes(parser):
    calls = [
        ToolCall("calculate", {"expression": "1 + 2"}),
        ToolCall("search", {"query": "Quenfold", "k": 2}),
    ]
    parsed = parser.parse(parser.format_calls(calls))
    assert parsed.calls == calls and parsed.errors == []


def test_smollm2_format_reads_a_list_or_one_object():
    p = SmolLM2Parser()
    text = (
        'Let me compute. <tool_call>[{"name": "calculate", "arguments": {"expression": "2*3"}}]</tool_call>'
    )
    assert p.parse(text).calls == [ToolCall("calculate", {"expression": "2*3"})]
    one = p.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert one.calls == [ToolCall("f", {"a": 1})]  # arguments given as a JSON string are decoded
    assert p.parse("The answer is 6.").attempted == 0


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "f"', "unclosed <tool_call>"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
        ("<tool_call>42</tool_call>", "must be a JSON object"),
    ],
)
def test_malformed_tagged_calls_are_errors_not_exceptions(text, error):
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and error in parsed.errors[0]


def test_hermes_reads_several_blocks():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert [c.name for c in HermesParser().parse(text).calls] == ["a", "b"]


def test_llama3_python_tag_and_plain_json():
    p = Llama3Parser()
    tagged = p.parse('<|python_tag|>{"name": "search", "parameters": {"query": "x"}}')
    assert tagged.calls == [ToolCall("search", {"query": "x"})]
    two = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    assert p.parse("It is 42.").attempted == 0
    bad = p.parse('<|python_tag|>{"name": "a", "parameters": ')
    assert bad.calls == [] and "not valid JSON" in bad.errors[0]


def test_parser_detection_from_chat_templates():
    assert detect_parser("{{ '<|im_start|>' + message['role'] }}") == "smollm2"
    assert detect_parser("{%- if tools %} ... <tool_call> ... {% endif %}") == "hermes"
    assert detect_parser("<|start_header_id|> {%- if tools %} <|python_tag|>") == "llama3"
    assert isinstance(get_parser("qwen"), HermesParser)
    with pytest.raises(ValueError, match="unknown tool parser 'mistral'"):
        get_parser("mistral")


@pytest.mark.parametrize(
    "expr,want",
    [
        ("1 + 2 * 3", "7"),
        ("(12 + 7) * 3", "57"),
        ("-4 - -6", "2"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ^ 3", "8"),
        ("3 × 4 ÷ 6", "2"),
        ("0.1 + 0.2", "0.3"),
        ("15 - 43 - 75 =", "-103"),
    ],
)
def test_calculator_evaluates_arithmetic(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize(
    "expr,error",
    [
        ("__import__('os').system('true')", "only numbers"),
        ("open('/etc/passwd').read()", "only numbers"),
        ("x + 1", "only numbers"),
        ("[1, 2]", "only numbers"),
        ("1 // 2", "only numbers"),
        ("lambda: 1", "only numbers"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" + "+1" * 150, "longer than"),
        ("-" * 40 + "1", "nested too deeply"),
    ],
)
def test_calculator_refuses_anything_else(expr, error):
    with pytest.raises(ValueError, match=error):
        safe_eval(expr)


class EchoEnv(ToolEnv):
    def __init__(self, **kwargs):
        super().__init__([lookup], **kwargs)

    def reset(self, item: dict) -> list[Message]:
        return [{"role": "user", "content": "weather?"}]

    def score(self, answer: str) -> float:
        return float("Oslo" in answer)


def _call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps([{"name": name, "arguments": args}]) + "</tool_call>"


def test_tool_env_runs_calls_and_scores_the_final_reply():
    env = EchoEnv()
    env.reset({})
    obs, reward, done, info = env.step(_call("lookup", city="Oslo"))
    assert obs == [{"role": "tool", "name": "lookup", "content": "Oslo 2020 C"}]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1, "valid_tool_calls": 1})
    obs, reward, done, info = env.step("It is cold in Oslo.")
    assert (obs, reward, done, info["score"]) == ([], 1.0, True, 1.0)


@pytest.mark.parametrize(
    "reply,error",
    [
        (_call("forecast", city="Oslo"), "unknown tool 'forecast'; available: lookup"),
        ('<tool_call>[{"name": "lookup", "arguments": {"city": }]</tool_call>', "not valid JSON"),
        (_call("lookup", city=3), "'city' must be str"),
        (_call("lookup", city="boom"), "lookup failed: sensor offline"),
    ],
)
def test_tool_errors_become_observations_with_a_penalty(reply, error):
    env = EchoEnv(tool_error_penalty=0.25)
    env.reset({})
    obs, reward, done, info = env.step(reply)
    assert not done and reward == -0.25
    assert (
        error in info["tool_error"] and obs[0]["content"].startswith("Error: ") and error in obs[0]["content"]
    )
    assert info["valid_tool_calls"] == 0 and info["tool_calls"] == 1


def test_too_many_calls_in_one_turn_are_refused():
    env = EchoEnv(max_calls_per_turn=2)
    env.reset({})
    reply = (
        "<tool_call>"
        + json.dumps([{"name": "lookup", "arguments": {"city": c}} for c in "abc"])
        + "</tool_call>"
    )
    obs, _, _, info = env.step(reply)
    assert info == {
        "tool_calls": 3,
        "valid_tool_calls": 2,
        "tool_error": "too many tool calls in one turn (at most 2)",
    }
    assert len(obs) == 3
