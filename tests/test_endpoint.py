"""The policy's OpenAI-compatible endpoint, driven by the openai client: completions, tool calls, batching,
OpenAI-style errors, and the capture of an episode's calls as trajectories (merged or split)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from polyrl.endpoint.capture import Call, EpisodeCapture, assemble, to_trajectories
from polyrl.endpoint.chat import Sample
from polyrl.endpoint.server import Endpoint, EndpointServer
from polyrl.engines.hf import Completion, HFEngine
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall
from polyrl.models.loading import load_model, load_tokenizer

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


@pytest.fixture(scope="module")
def tiny(tok):
    torch.manual_seed(0)
    return HFEngine(load_model("tiny-random", None, seed=0), tok, bf16=False)


class ScriptedEngine:
    """Replies ``script(prompt_text)`` tokenised and ended with the stop token, log-prob -0.5 per token;
    records the rows of each generate call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.stop_ids = {tokenizer.eos_token_id}
        self.calls: list[int] = []

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, stop=None):
        self.calls.append(len(prompts) * n)
        out = []
        for p in prompts:
            ids = self.tokenizer(self.script(self.tokenizer.decode(p)), add_special_tokens=False).input_ids
            ids = (ids + [self.tokenizer.eos_token_id])[:max_new_tokens]
            out.append([Completion(list(ids), [-0.5] * len(ids), ids[-1] == self.tokenizer.eos_token_id)
                        for _ in range(n)])
        return out


def serve(engine, names=("tiny",)):
    return EndpointServer(Endpoint(engine, names)).start()


def client(server, url=None):
    return openai.AsyncOpenAI(base_url=url or server.base_url, api_key="unused", max_retries=0)


def adder(prompt: str) -> str:
    """Calls add on the first turn, answers with the tool's result after it."""
    if "<|im_start|>tool\n" in prompt:
        return "The answer is " + prompt.split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0]
    return SmolLM2Parser().format_calls([ToolCall("add", {"a": 2, "b": 3})])


# --- the endpoint --------------------------------------------------------------------------------------------


def test_a_client_given_the_address_before_the_server_starts_is_answered(tok):
    """``polyrl serve`` prints the address, then starts uvicorn: a client as quick as that is held in the
    listening socket's backlog and answered once the server runs, never refused."""
    import socket

    server = EndpointServer(Endpoint(ScriptedEngine(tok, lambda prompt: "hi"), ("tiny",)))
    early = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # refused before the fix
    early.close()
    server.start()
    with urllib.request.urlopen(server.base_url + "/models", timeout=30) as reply:
        assert json.loads(reply.read())["data"][0]["id"] == "tiny"

@pytest.mark.slow
def test_completions_report_tokens_logprobs_and_usage(tiny):
    server = serve(tiny)

    async def main():
        async with client(server) as c:
            return await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   n=3, max_tokens=6, logprobs=True, temperature=1.0)

    r = asyncio.run(main())
    assert len(r.choices) == 3 and r.object == "chat.completion"
    lengths = []
    for choice in r.choices:
        content = choice.logprobs.content
        assert all(t.logprob < 0 for t in content) and "".join(t.token for t in content) == choice.message.content
        length = len(content) + (choice.finish_reason == "stop")  # the stop token counts, but is not content
        assert choice.finish_reason == "length" if length == 6 else choice.finish_reason == "stop"
        lengths.append(length)
    assert r.usage.completion_tokens == sum(lengths)
    prompt = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(prompt["input_ids"])
    server.stop()


def test_tool_calls_come_back_parsed_and_tool_choice_none_keeps_text(tok):
    server = serve(ScriptedEngine(tok, adder))

    async def main():
        async with client(server) as c:
            msgs = [{"role": "user", "content": "What is 2 + 3?"}]
            called = await c.chat.completions.create(model="tiny", messages=msgs, tools=[ADD])
            plain = await c.chat.completions.create(model="tiny", messages=msgs, tools=[ADD], tool_choice="none")
            return called, plain

    called, plain = asyncio.run(main())
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content.startswith("<tool_call>")
    server.stop()


def test_bad_requests_get_openai_400_errors(tok):
    server = serve(ScriptedEngine(tok, adder))
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "gpt-4o"}, "model", "model_not_found"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", None),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters", None),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", None),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"n": 0}, "n", None),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ]

    async def main():
        errors = []
        async with client(server) as c:
            for extra, _, _ in cases:
                body = {"model": "tiny", "messages": msgs, **extra}
                with pytest.raises(openai.BadRequestError) as caught:
                    await c.chat.completions.create(**body)
                errors.append(caught.value)
        return errors

    for err, (_, param, code) in zip(asyncio.run(main()), cases, strict=True):
        assert err.status_code == 400 and err.body["type"] == "invalid_request_error"
        assert err.body["param"] == param and err.body["code"] == code
    request = urllib.request.Request(f"{server.base_url}/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=10)
    assert raw.value.code == 400 and json.loads(raw.value.read())["error"]["type"] == "invalid_request_error"
    server.stop()


def test_concurrent_requests_share_one_generate_call(tok):
    engine = ScriptedEngine(tok, adder)
    server = serve(engine)
    b = server.endpoint.batcher
    b.window_s, b.max_wait_s, b.expected = 30.0, 30.0, lambda: 6  # wait for all six

    async def main():
        async with client(server) as c:
            return await asyncio.gather(*[c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"question {i}"}], tools=[ADD]) for i in range(6)])

    replies = asyncio.run(main())
    assert engine.calls == [6] and all(r.choices[0].message.tool_calls for r in replies)
    server.stop()


def test_each_request_keeps_its_own_token_limit_and_stop_string(tiny):
    server = serve(tiny)
    msgs = [{"role": "user", "content": "Tell me"}]

    async def main():
        async with client(server) as c:
            free = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
            text = free.choices[0].message.content
            stop = text[len(text) // 2 :][:3]
            server.endpoint.batcher.max_wait_s, server.endpoint.batcher.expected = 30.0, lambda: 2  # both in one
            short, cut = await asyncio.gather(
                c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0),
                c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stop=[stop]))
            return free, short, cut, stop

    free, short, cut, stop = asyncio.run(main())
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 12
    assert short.usage.completion_tokens == 3 and free.choices[0].message.content.startswith(
        short.choices[0].message.content)
    text = free.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[: text.find(stop)]
    assert server.endpoint.batcher.batch_rows[-1] == 2  # the two went into one generate call
    server.stop()


# --- capture ---------------------------------------------------------------------------------------------------

def _sample(ids):
    return Sample(ids, [-0.1] * len(ids), "", eos=True)


def test_assemble_merges_extensions_and_splits_the_rest():
    calls = [Call([1, 2], [_sample([3, 4])]),
             Call([1, 2, 3, 4, 5], [_sample([6])]),  # extends call 1: env token 5
             Call([1, 9], [_sample([7]), _sample([8])])]  # extends nothing; its second choice is a 3rd trajectory
    built, merged = assemble(calls)
    assert merged == 1 and len(built) == 3
    first = built[0]
    assert first.ids == [1, 2, 3, 4, 5, 6] and first.loss_mask == [0, 0, 1, 1, 0, 1]
    assert first.logprobs == [0.0, 0.0, -0.1, -0.1, 0.0, -0.1] and first.spans == [(2, 4), (5, 6)]
    assert built[1].ids == [1, 9, 7] and built[2].ids == [1, 9, 8] and built[2].loss_mask == [0, 0, 1]


def _episode(server, agent):
    eid = "e1"
    server.call(server.endpoint.open_episode, eid)
    asyncio.run(agent(client(server, server.episode_url(eid))))
    return server.call(server.endpoint.close_episode, eid)


async def tool_loop(c, rewrite=False):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(2):
        reply = (await c.chat.completions.create(model="tiny", messages=msgs, tools=[ADD])).choices[0].message
        if not reply.tool_calls:
            return reply.content
        if rewrite:  # the agent keeps a summary of its call instead of the reply itself
            msgs.append({"role": "assistant", "content": "I called add."})
        else:
            msgs.append(reply.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"})
    return None


def test_a_chat_loop_merges_into_one_trajectory_with_env_tokens_masked(tok):
    server = serve(ScriptedEngine(tok, adder))
    capture = _episode(server, tool_loop)
    (traj,) = to_trajectories(capture, "add", 0, 0, 1.0, 3, {}, tok)
    assert traj.info["capture"] == "merged" and traj.info["merged_calls"] == 1 and traj.info["split_calls"] == 0
    (a, b), (c, d) = traj.turn_spans
    call = tok(SmolLM2Parser().format_calls([ToolCall("add", {"a": 2, "b": 3})]), add_special_tokens=False)
    assert traj.input_ids[a:b] == call.input_ids + [tok.eos_token_id] and set(traj.loss_mask[a:b]) == {1}
    assert tok.decode(traj.input_ids[b:c]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert set(traj.loss_mask[b:c]) == {0} and traj.versions[a] == 3 and traj.versions[b] == -1
    assert tok.decode(traj.input_ids[c:d]) == "The answer is 5<|im_end|>" and d == len(traj.input_ids)
    assert traj.reward == 1.0 and sum(traj.loss_mask) == (b - a) + (d - c)
    server.stop()


def test_rewritten_history_splits_into_one_trajectory_per_call(tok):
    server = serve(ScriptedEngine(tok, adder))
    capture = _episode(server, lambda c: tool_loop(c, rewrite=True))
    trajs = to_trajectories(capture, "add", 0, 0, 0.5, 0, {}, tok)
    assert [t.info["capture"] for t in trajs] == ["split", "split"] and [t.reward for t in trajs] == [0.5, 0.5]
    assert trajs[0].info["split_calls"] == 1 and trajs[0].info["merged_calls"] == 0
    assert "I called add." in tok.decode(trajs[1].input_ids[: trajs[1].prompt_len])
    server.stop()


THINK_DROPPING = (  # renders earlier assistant turns without their <think> block, as reasoning templates do
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_drops_think_blocks_splits_the_calls(tok):
    thinking = load_tokenizer("tiny-random")
    thinking.chat_template = THINK_DROPPING
    server = serve(ScriptedEngine(thinking, lambda p: "<think>2 and 3</think>5"))

    async def agent(c):
        msgs = [{"role": "user", "content": "2 + 3?"}]
        reply = (await c.chat.completions.create(model="tiny", messages=msgs)).choices[0].message
        msgs += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        await c.chat.completions.create(model="tiny", messages=msgs)

    capture = _episode(server, agent)
    first, second = to_trajectories(capture, "t", 0, 0, 1.0, 0, {}, thinking)
    assert first.info["capture"] == "split" and "<think>" in thinking.decode(first.input_ids)
    assert "<think>" not in thinking.decode(second.input_ids[: second.prompt_len])
    server.stop()


def test_calls_after_an_episode_closes_are_refused(tok):
    server = serve(ScriptedEngine(tok, adder))
    server.call(server.endpoint.open_episode, "gone")
    assert isinstance(server.call(server.endpoint.close_episode, "gone"), EpisodeCapture)

    async def main():
        async with client(server, server.episode_url("gone")) as c:
            with pytest.raises(openai.BadRequestError, match="not open"):
                await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

    asyncio.run(main())
    server.stop()
