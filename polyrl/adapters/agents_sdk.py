"""OpenAI Agents SDK agents trained through the policy's endpoint.

An agent task's ``run(client, item)`` gets the episode's ``openai.AsyncOpenAI`` client; ``run_agent`` runs an
``agents.Agent`` (its tools, handoffs and guardrails as written) with every model call of the run sent to that
client through the SDK's ``OpenAIChatCompletionsModel``, so each call is captured for training. Tracing is off
(nothing may leave the machine). What the model gets wrong ends the run, not the episode: a call to a tool that
does not exist is answered with an error the model sees, and a run that breaks the SDK's rules or uses up its
turns comes back with ``error`` set and no output, for the caller to score (usually 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _sdk() -> Any:
    try:
        import agents
    except ImportError:
        raise ImportError("the OpenAI Agents SDK is not installed; pip install 'polyrl[agents]'") from None
    return agents


@dataclass
class AgentRun:
    """What an Agents SDK run produced: its final output, or why it has none."""

    output: Any | None
    error: str | None
    """``max_turns`` or ``model_behavior: <the SDK's message>`` when the run ended without an output."""
    result: Any | None
    """The SDK's ``RunResult`` (its ``new_items`` list the tool calls), when the run finished."""

    def tool_calls(self) -> list[str]:
        """Names of the tools the run called, in order."""
        if self.result is None:
            return []
        return [item.raw_item.name for item in self.result.new_items if item.type == "tool_call_item"
                and hasattr(item.raw_item, "name")]


async def run_agent(agent: Any, client: Any, prompt: str | list[dict[str, Any]], *, max_turns: int = 8,
                    model: str = "policy", context: Any = None) -> AgentRun:
    """Run ``agent`` on ``prompt`` with its model calls sent to ``client`` (the episode's endpoint client)."""
    sdk = _sdk()
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

    config = sdk.RunConfig(model=sdk.OpenAIChatCompletionsModel(model=model, openai_client=client),
                           tracing_disabled=True, tool_not_found_behavior="return_error_to_model")
    try:
        result = await sdk.Runner.run(agent, prompt, context=context, max_turns=max_turns, run_config=config)
    except MaxTurnsExceeded:
        return AgentRun(None, "max_turns", None)
    except ModelBehaviorError as err:  # e.g. tool arguments that are not JSON, an output of the wrong type
        return AgentRun(None, f"model_behavior: {err}", None)
    return AgentRun(result.final_output, None, result)
