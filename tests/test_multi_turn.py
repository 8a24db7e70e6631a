"""Multi-turn rollouts: token-faithful trajectories, loss masks, budgets, batching, RL steps on tool math."""

import json
import re

import pytest
import torch
from conftest import ROOT

from polyrl.config import RolloutConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.engines.hf import Completion, HFEngine
from polyrl.envs import ENVS, make_task
from polyrl.envs.tool_parsers import HermesParser, SmolLM2Parser, ToolCall
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.rollout.multi_turn import evaluate, play, rollout, rollout_metrics, to_trajectory
from polyrl.rollout.render import ChatRenderer, template_supports_tools

# Qwen2.5-Instruct's chat template (tools in the system turn, tool results grouped in a user turn).
QWEN25_TEMPLATE = (ROOT / "tests" / "data" / "qwen25_chat_template.jinja").read_text()

TOOL_MATH = TaskConfig(
    name="tool_math",
    max_turns=3,
    params={"dataset": "chain_sum", "dataset_params": {"min_terms": 2, "max_terms": 2, "min_digits": 2}},
)


pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedEngine:
    """Replies from ``script(prompt_text, sample_index)``, tokenised canonically and ended with the stop
    token, with made-up log-probs; records every generate call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.stop_ids = {tokenizer.eos_token_id}
        self.calls: list[tuple[int, int, int]] = []

    def reply_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0):
        self.calls.append((len(prompts), n, max_new_tokens))
        out = []
        for p in prompts:
            group = []
            for j in range(n):
                ids = self.reply_ids(self.script(self.tokenizer.decode(p), j))
                cut = ids[:max_new_tokens]
                group.append(
                    Completion(cut, [-0.01 * (k + 1) for k in range(len(cut))], len(ids) <= max_new_tokens)
                )
            out.append(group)
        return out


TOOL_RESULT = re.compile(r"(?:<\|im_start\|>tool\n|<tool_response>\n)(-?\d+)")


def calculator_script(parser):
    """Sample 0 answers at once; the others call calculate on the problem, then answer with the result."""

    def script(prompt: str, j: int) -> str:
        if TOOL_RESULT.search(prompt):
            return f"The answer is {TOOL_RESULT.findall(prompt)[-1]}"
        if j == 0:
            return "The answer is 12"
        expression = re.findall(r"problem: (.*?) =", prompt)[-1]
        return parser.format_calls([ToolCall("calculate", {"expression": expression})])

    return script


def _check_faithful(episode, engine, tok):
    """The trajectory is the chat template's rendering of the final conversation, token for token, and the
    loss mask covers exactly the model's replies."""
    traj = to_trajectory(episode, tok)
    rendered = episode.renderer.encode(episode.renderer.text(episode.messages, add_generation_prompt=False))
    assert traj.input_ids == rendered[: len(traj.input_ids)]
    assert tok.decode(rendered[len(traj.input_ids) :]) == "\n"  # the template's newline after the last turn
    replies = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    assert len(traj.turn_spans) == len(replies) == traj.info["turns"]
    masked = [i for i, m in enumerate(traj.loss_mask) if m]
    assert masked == [i for a, b in traj.turn_spans for i in range(a, b)]
    for (a, b), reply in zip(traj.turn_spans, replies, strict=True):
        assert traj.input_ids[a:b] == engine.reply_ids(reply)
        assert traj.logprobs[a:b] == pytest.approx([-0.01 * (k + 1) for k in range(b - a)])
        assert traj.versions[a:b] == [7] * (b - a)
    env_positions = [i for i, m in enumerate(traj.loss_mask) if not m and i >= traj.prompt_len]
    assert all(traj.logprobs[i] == 0.0 and traj.versions[i] == -1 for i in env_positions)
    return traj, env_positions


@pytest.mark.parametrize("template", ["smollm2", "qwen2.5"])
def test_trajectories_are_the_rendered_conversation_token_for_token(tok, template):
    if template == "qwen2.5":
        tok = load_tokenizer("tiny-random")
        tok.chat_template = QWEN25_TEMPLATE
    task = make_task(TOOL_MATH, seed=0, tokenizer=tok)
    parser = task.make_env().tool_parser
    assert isinstance(parser, HermesParser if template == "qwen2.5" else SmolLM2Parser)
    engine = ScriptedEngine(tok, calculator_script(parser))
    requests = [(task, i, task.train_item(i)) for i in range(2)]
    episodes = play(engine, requests, RolloutConfig(group_size=3, max_new_tokens=64), seed=0, version=7)
    assert len(episodes) == 6
    for e in episodes:
        traj, env_positions = _check_faithful(e, engine, tok)
        if traj.info["turns"] == 2:
            env_text = tok.decode([traj.input_ids[i] for i in env_positions])
            assert str(e.item["answer"]) in env_text and "assistant" in env_text  # tool result + next prompt
            assert traj.reward == 1.0 and traj.info["valid_tool_calls"] == 1
        else:
            assert env_positions == [] and traj.info["turns"] == 1
    assert [e.turns for e in episodes] == [1, 2, 2, 1, 2, 2]
    # first turn: one prefill per group; second turn: the four still-active samples together
    assert engine.calls == [(2, 3, 64), (4, 1, 64)]


def test_native_tool_templates_get_the_tools_argument(tok):
    qwen = load_tokenizer("tiny-random")
    qwen.chat_template = QWEN25_TEMPLATE
    assert template_supports_tools(qwen) and not template_supports_tools(tok)
    task = make_task(TOOL_MATH, seed=0, tokenizer=qwen)
    env = task.make_env()
    text = ChatRenderer(qwen, env.tools, env.tool_parser).text(env.reset(task.train_item(0)), True)
    assert "# Tools" in text and '"name": "calculate"' in text and "You have access" not in text


def test_templates_that_rewrite_replies_fall_back_to_the_wrapper(tok):
    trimming = load_tokenizer("tiny-random")
    trimming.chat_template = (
        "{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] | trim) + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    task = make_task(TOOL_MATH, seed=0, tokenizer=trimming)
    parser = task.make_env().tool_parser
    # trailing whitespace, which the template trims when it re-renders the reply
    call = parser.format_calls([ToolCall("calculate", {"expression": "1 + 1"})]) + "  \n"
    engine = ScriptedEngine(trimming, lambda prompt, j: "The answer is 2" if "tool\n2" in prompt else call)
    (e,) = play(engine, [(task, 0, task.train_item(0))], RolloutConfig(group_size=1, max_new_tokens=64), seed=0,
                version=7)
    traj = to_trajectory(e, trimming)
    (a, b), (c, d) = traj.turn_spans
    assert traj.input_ids[a:b] == engine.reply_ids(call)  # the model's tokens, trailing spaces included
    assert trimming.decode(traj.input_ids[b:c]) == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


def test_turn_limit_and_token_budget_truncate(tok):
    looping = ScriptedEngine(
        tok, lambda prompt, j: SmolLM2Parser().format_calls([ToolCall("calculate", {"expression": "2 * 21"})])
    )
    task = make_task(TOOL_MATH.model_copy(update={"max_turns": 4}), seed=0)
    one_sample = RolloutConfig(group_size=1, max_new_tokens=64)
    (traj,) = rollout(looping, [(task, 0, task.train_item(0))], one_sample, seed=0, version=0)
    assert traj.info["turns"] == 4 and traj.truncated and traj.info["score"] == 0.0
    assert traj.info["tool_calls"] == traj.info["valid_tool_calls"] == 4

    budget = make_task(TOOL_MATH.model_copy(update={"max_turns": 10, "max_tokens": 120}), seed=0)
    (traj,) = rollout(looping, [(budget, 0, budget.train_item(0))], one_sample, seed=0, version=0)
    assert traj.truncated and len(traj.input_ids) - traj.prompt_len <= 120
    assert traj.info["turns"] < 10

    wordy = ScriptedEngine(tok, lambda prompt, j: "word " * 100)
    (traj,) = rollout(wordy, [(task, 0, task.train_item(0))], one_sample.model_copy(update={"max_new_tokens": 16}),
                      seed=0, version=0)
    # cut at the per-turn limit: the cut reply is still the final answer, scored and flagged as truncated
    assert traj.num_model_tokens == 16 and traj.truncated and traj.info["turns"] == 1


@pytest.fixture(scope="module")
def tiny_engine(tok):
    return HFEngine(load_model("tiny-random", seed=0), tok, bf16=False)


def test_random_model_multi_turn_is_token_faithful(tiny_engine, tok):
    """A random model's tokens are rarely what the tokenizer would produce for their text, so any
    decode/re-encode step would change them; the trajectory must keep them exactly."""
    task = make_task(TaskConfig(name="frozen_lake", max_turns=3), seed=0, tokenizer=tok)
    generated: list[list[int]] = []
    real = tiny_engine.generate

    def recording(prompts, n=1, *args, **kwargs):
        out = real(prompts, n, *args, **kwargs)
        generated.extend(c.token_ids for group in out for c in group)
        return out

    tiny_engine.generate = recording
    try:
        episodes = play(tiny_engine, [(task, 0, task.train_item(0))], RolloutConfig(group_size=2, max_new_tokens=12),
                        seed=3, version=5)
    finally:
        del tiny_engine.generate
    drift = 0
    for e in episodes:
        traj = to_trajectory(e, tok)
        assert (
            traj.info["turns"] == 3 and traj.truncated
        )  # random replies are invalid moves: the game goes on
        rendered = e.renderer.text(e.messages, add_generation_prompt=False)
        assert rendered.startswith(tok.decode(traj.input_ids))  # same conversation, as text
        for a, b in traj.turn_spans:
            assert traj.input_ids[a:b] in generated and traj.versions[a:b] == [5] * (b - a)
        masked = [i for i, m in enumerate(traj.loss_mask) if m]
        assert masked == [i for a, b in traj.turn_spans for i in range(a, b)]
        between = traj.input_ids[traj.turn_spans[0][1] : traj.turn_spans[1][0]]
        assert "Invalid action" in tok.decode(between)
        first_reply = e.messages[2]
        assert first_reply["role"] == "assistant"
        a, b = traj.turn_spans[0]
        model_tokens = [t for t in traj.input_ids[a:b] if t not in tiny_engine.stop_ids]
        drift += tok(first_reply["content"], add_special_tokens=False).input_ids != model_tokens
    assert drift > 0, "re-encoding the replies would have changed some tokens (the test can see drift)"


def test_greedy_evaluation_over_the_env(tiny_engine):
    task = make_task(TOOL_MATH.model_copy(update={"eval_size": 3}), seed=0)
    result = evaluate(tiny_engine, task, None, max_new_tokens=6)
    assert result["n"] == 3 and 0.0 <= result["accuracy"] <= 1.0 and result["turns/mean"] >= 1
    assert "valid_tool_call_rate" in result and result == evaluate(tiny_engine, task, None, max_new_tokens=6)


def test_rollout_metrics():
    class T:
        def __init__(self, **info):
            self.info = info

    m = rollout_metrics(
        [
            T(turns=2, tool_calls=2, valid_tool_calls=1, tool_errors=["x"]),
            T(turns=1, tool_calls=0, valid_tool_calls=0, tool_errors=[]),
        ]
    )
    assert m == {
        "turns/mean": 1.5,
        "tool_calls/mean": 1.0,
        "valid_tool_call_rate": 0.5,
        "tool_errors/mean": 0.5,
    }
    assert rollout_metrics([T(turns=1)]) == {"turns/mean": 1}
    assert (
        rollout_metrics([T(turns=1, tool_calls=0, valid_tool_calls=0, tool_errors=[])])[
            "valid_tool_call_rate"
        ]
        is None
    )


class ForcedFirstTurn:
    """The real tiny-model engine, except that half the first-turn samples are a forced calculate call (with
    the model's own log-probs), so a random model still produces multi-turn tool trajectories."""

    def __init__(self, engine: HFEngine):
        self.engine, self.tokenizer, self.stop_ids = engine, engine.tokenizer, engine.stop_ids
        self.call = self.tokenizer(
            SmolLM2Parser().format_calls([ToolCall("calculate", {"expression": "6 * 7"})]),
            add_special_tokens=False,
        ).input_ids + [self.tokenizer.eos_token_id]

    def _logprobs(self, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
        with torch.no_grad():
            logits = self.engine.policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        return logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0):
        out = self.engine.generate(prompts, n, max_new_tokens, temperature, top_p, seed)
        if n > 1:
            for p, group in zip(prompts, out, strict=True):
                for j in range(0, n, 2):
                    group[j] = Completion(self.call, self._logprobs(p, self.call, temperature), True)
        return out

    def sync(self) -> None:
        self.engine.sync()

    def release_memory(self, until_used: bool = False) -> None:
        self.engine.release_memory(until_used)


@pytest.mark.slow
def test_rl_steps_on_tool_math_mask_env_tokens(tmp_path):
    from polyrl.train.step import build_run, rl_step

    cfg = load_config(
        ROOT / "configs" / "tool_math.yaml",
        [
            "model.name=tiny-random",
            "model.bf16=false",
            "rollout.group_size=4",
            "rollout.max_new_tokens=40",
            "tasks.0.max_tokens=160",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    run = build_run(cfg, tmp_path)
    run.engine = ForcedFirstTurn(run.engine)
    for step in (1, 2):
        metrics, trajectories = rl_step(run, step)
        assert metrics["tool_calls/mean"] >= 0.5 and metrics["valid_tool_call_rate"] == 1.0
        assert metrics["turns/mean"] > 1 and torch.isfinite(torch.tensor(metrics["loss"]))
        forced = [t for t in trajectories if t.info["tool_calls"]]
        assert len(forced) == len(trajectories) // 2
        for t in forced:
            (a, b), (c, _) = t.turn_spans[:2]
            env_tokens = t.input_ids[b:c]
            assert set(t.loss_mask[b:c]) == {0} and "<|im_start|>tool\n42<|im_end|>" in run.tokenizer.decode(
                env_tokens
            )
            assert t.input_ids[a:b] == run.engine.call and set(t.loss_mask[a:b]) == {1}
    json.dumps([t.info for t in trajectories])  # stored in trajectories.jsonl


def _docs_example() -> str:
    text = (ROOT / "docs" / "environments.md").read_text()
    return re.search(
        r"<!-- example:start -->\s*```python\n(.*?)```\s*<!-- example:end -->", text, re.DOTALL
    ).group(1)


@pytest.fixture
def registry_restored():
    """ENVS as it was before the test: the docs' example registers itself, and later tests in this process
    compare the registry with a fresh `polyrl tasks` (tests/test_cli_tasks_dryrun.py)."""
    saved = dict(ENVS)
    yield
    ENVS.clear()
    ENVS.update(saved)


def test_the_documented_example_env_runs(tok, registry_restored):
    namespace: dict = {}
    exec(compile(_docs_example(), "docs/environments.md", "exec"), namespace)  # noqa: S102 - the doc's own code
    cfg = TaskConfig(name="unit_conversion", max_turns=3)
    task = make_task(cfg, seed=0, tokenizer=tok)
    item = task.train_item(0)

    def script(prompt: str, j: int) -> str:
        if "<|im_start|>tool" not in prompt:
            return SmolLM2Parser().format_calls(
                [ToolCall("to_meters", {"value": item["value"], "unit": item["unit"]})]
            )
        return "It is " + re.findall(r"<\|im_start\|>tool\n([\d.]+)", prompt)[-1]

    engine = ScriptedEngine(tok, script)
    (traj,) = rollout(engine, [(task, 0, item)], RolloutConfig(group_size=1, max_new_tokens=64), seed=0, version=0)
    assert traj.reward == 1.0 and traj.info["turns"] == 2 and traj.info["valid_tool_calls"] == 1
