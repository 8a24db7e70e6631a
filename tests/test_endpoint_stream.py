"""The endpoint as agents written against the openai client use it: streamed completions (text and tool calls),
tool_choice enforced by sampling again, per-request seeds, clients that go away, and capture that trains on
the sampled token ids even where the tokenizer would spell the text otherwise."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import torch
from test_agent_tasks import _config
from test_endpoint import ADD, ScriptedEngine, _episode, adder, client, serve

from polyrl.endpoint.capture import to_trajectories
from polyrl.endpoint.rollout import Outcome, capture_metrics
from polyrl.endpoint.server import Sampling
from polyrl.endpoint.stream import TextStream
from polyrl.engines.hf import Completion, HFEngine
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall
from polyrl.models.loading import load_model

MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
ASK = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def tiny(tok):
    torch.manual_seed(0)
    return HFEngine(load_model("tiny-random", None, seed=0), tok, bf16=False)


class Spy:
    """An engine that records every completion it returns."""

    def __init__(self, engine):
        self.engine, self.completions = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        groups = self.engine.generate(*args, **kwargs)
        self.completions += [c for group in groups for c in group]
        return groups


class StepEngine:
    """Samples ``ids`` in every row one decoding step at a time through the ``stop`` hook, ``step_s`` apart, as
    HFEngine does; then the stop token (``end``) or ``ids`` again. Records each call's row lengths."""

    def __init__(self, tokenizer, ids, end=True, step_s=0.0):
        self.tokenizer, self.ids, self.end, self.step_s = tokenizer, list(ids), end, step_s
        self.stop_ids = {tokenizer.eos_token_id}
        self.lengths: list[list[int]] = []

    def token(self, step):
        if step < len(self.ids):
            return self.ids[step]
        return self.tokenizer.eos_token_id if self.end else self.ids[step % len(self.ids)]

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, stop=None):
        rows = [[] for _ in range(len(prompts) * n)]
        live = list(range(len(rows)))
        for step in range(max_new_tokens):
            time.sleep(self.step_s)
            tokens = [self.token(step)] * len(live)
            flags = stop(live, tokens, [-0.5] * len(live), None) if stop else [False] * len(live)
            for row, t in zip(live, tokens, strict=True):
                rows[row].append(t)
            live = [r for r, t, f in zip(live, tokens, flags, strict=True) if not f and t not in self.stop_ids]
            if not live:
                break
        self.lengths.append([len(r) for r in rows])
        done = [Completion(r, [-0.5] * len(r), r[-1] in self.stop_ids) for r in rows]
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]


async def _stream(c, **kwargs):
    return [chunk async for chunk in await c.chat.completions.create(stream=True, **kwargs)]


def _deltas(chunks, index=0):
    return [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]


def _text(chunks, index=0):
    return "".join(d.delta.content or "" for d in _deltas(chunks, index))


# --- streaming ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_streamed_text_is_the_non_streamed_text_and_capture_keeps_the_sampled_tokens(tiny, tok):
    spy = Spy(tiny)
    server = serve(spy)
    kw = {"model": "tiny", "messages": ASK, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 7, "logprobs": True}

    async def main():
        async with client(server) as c:
            whole = await c.chat.completions.create(**kw)
            chunks = await _stream(c, stream_options={"include_usage": True}, **kw)
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    for i, choice in enumerate(whole.choices):
        deltas = _deltas(chunks, i)
        assert _text(chunks, i) == choice.message.content and sum(bool(d.delta.content) for d in deltas) > 1
        assert [d.finish_reason for d in deltas if d.finish_reason] == [choice.finish_reason]
        streamed = [t.logprob for d in deltas if d.logprobs for t in d.logprobs.content]
        assert streamed == [t.logprob for t in choice.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])

    # Through an episode: what trains is exactly what the engine sampled; the stream spelled the same.
    spy.completions.clear()
    capture = _episode(server, lambda c: _stream(c, model="tiny", messages=ASK, max_tokens=16))
    (traj,), (sampled,) = to_trajectories(capture, "t", 0, 0, 1.0, 0, {}, tok), spy.completions
    assert traj.input_ids[traj.prompt_len:] == sampled.token_ids and set(traj.loss_mask[traj.prompt_len:]) == {1}
    assert traj.logprobs[traj.prompt_len:] == sampled.logprobs
    server.stop()


STREAMING_AGENT = """
async def run(client, item):
    stream = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": item["q"]}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    return float(len(text) % 2)
"""


@pytest.mark.slow
def test_a_streaming_agent_trains_on_the_sampled_tokens(tmp_path, monkeypatch):
    from polyrl.train.step import build_run, rl_step

    tasks = [{"name": "s", "agent": "streaming_agent:run", "items": [{"q": "hi"}, {"q": "yo"}]}]
    run = build_run(_config(tmp_path, monkeypatch, "streaming_agent", STREAMING_AGENT, tasks), tmp_path / "run")
    run.engine = spy = Spy(run.engine)
    metrics, trajectories = rl_step(run, 1)
    assert metrics["agent/dropped"] == 0 and len(trajectories) == 4 and math.isfinite(metrics["loss"])
    sampled = sorted(c.token_ids for c in spy.completions)
    assert sorted(t.input_ids[t.prompt_len:] for t in trajectories) == sampled


def test_text_stream_holds_back_split_characters_and_stop_strings(tok):
    text = "Grüße 🦜 done. STOP here"
    ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(len(ids)))  # a character spans several tokens
    stream = TextStream(tok, {tok.eos_token_id}, ["STOP"])
    parts = [stream.push(t) for t in ids]
    assert "".join(parts) == "Grüße 🦜 done. " and not any("\ufffd" in p or "S" in p for p in parts)
    # "done!" may start at "done": nothing from there is sent until "." settles it.
    stream = TextStream(tok, {tok.eos_token_id}, ["done!"])
    sent = []
    for t in ids:
        stream.push(t)
        sent.append(stream.sent)
    assert sent[-1] == text and not any(s.endswith("done") for s in sent)
    assert stream.rest(text) == ""


def test_streamed_tool_calls_come_whole_and_the_next_turn_merges(tok):
    server = serve(ScriptedEngine(tok, adder))
    seen = {}

    async def agent(c):
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        chunks = await _stream(c, model="tiny", messages=msgs, tools=[ADD])
        deltas = _deltas(chunks)
        (call,) = [tc for d in deltas for tc in d.delta.tool_calls or []]
        seen["call"], seen["finish"] = call, deltas[-1].finish_reason
        msgs += [{"role": "assistant", "content": _text(chunks) or None, "tool_calls": [
                     {"id": call.id, "type": "function", "function": call.function.model_dump()}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        seen["answer"] = _text(await _stream(c, model="tiny", messages=msgs, tools=[ADD]))

    capture = _episode(server, agent)
    call = seen["call"]
    assert call.index == 0 and call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3} and seen["finish"] == "tool_calls"
    assert seen["answer"] == "The answer is 5"
    (traj,) = to_trajectories(capture, "add", 0, 0, 1.0, 0, {}, tok)
    assert traj.info["capture"] == "merged" and len(traj.turn_spans) == 2
    server.stop()


# --- tool_choice -----------------------------------------------------------------------------------------------

class PerRow(ScriptedEngine):
    """ScriptedEngine asking its script once per row (not once per prompt)."""

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, stop=None):
        self.calls.append(len(prompts) * n)
        eos = self.tokenizer.eos_token_id
        rows = [self.tokenizer(self.script(self.tokenizer.decode(p)), add_special_tokens=False).input_ids + [eos]
                for p in prompts for _ in range(n)]
        done = [Completion(r, [-0.5] * len(r), True) for r in rows]
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]


def _replies(tok, *texts):
    """An engine whose successive rows reply ``texts`` in turn."""
    it = iter(texts)
    return PerRow(tok, lambda prompt: next(it))


def _call(name):
    return SmolLM2Parser().format_calls([ToolCall(name, {"a": 2, "b": 3})])


def test_tool_choice_samples_again_until_the_call_it_asks_for(tok):
    server = serve(_replies(tok))
    server.endpoint.batcher.window_s = 0.0  # one request at a time: no batch to wait for
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]

    def ask(engine, tool_choice, tries=3, n=1):
        server.endpoint.batcher.engine, server.endpoint.tool_choice_tries = engine, tries

        async def main():
            async with client(server) as c:
                return await c.chat.completions.create(model="tiny", messages=msgs, tools=[ADD, MUL],
                                                       tool_choice=tool_choice, n=n)

        return asyncio.run(main()).choices

    add = {"type": "function", "function": {"name": "add"}}
    engine = _replies(tok, "Five.", _call("mul"))
    (choice,) = ask(engine, "required")
    assert engine.calls == [1, 1] and choice.message.tool_calls[0].function.name == "mul"
    engine = _replies(tok, "Five.", _call("mul"), _call("add"))
    (choice,) = ask(engine, add)
    assert engine.calls == [1, 1, 1] and choice.message.tool_calls[0].function.name == "add"
    assert choice.finish_reason == "tool_calls"
    # Tries spent: the last sample comes back as "auto" would return it.
    engine = _replies(tok, "Five.", _call("mul"), _call("add"))
    (choice,) = ask(engine, add, tries=2)
    assert engine.calls == [1, 1] and choice.message.tool_calls[0].function.name == "mul"
    engine = _replies(tok, "Five.", "Still five.")
    (choice,) = ask(engine, "required", tries=2)
    assert engine.calls == [1, 1] and choice.message.content == "Still five." and choice.finish_reason == "stop"
    # "auto" takes the first sample, call or not.
    engine = _replies(tok, "Five.")
    (choice,) = ask(engine, "auto")
    assert engine.calls == [1] and choice.message.content == "Five."
    # Only the choices without the call are sampled again.
    engine = _replies(tok, _call("add"), "Five.", _call("mul"))
    first, second = ask(engine, "required", n=2)
    assert engine.calls == [2, 1] and first.message.tool_calls[0].function.name == "add"
    assert second.message.tool_calls[0].function.name == "mul"
    server.stop()


def test_an_episode_trains_on_the_accepted_sample_only(tok):
    server = serve(_replies(tok, "Five.", _call("add")))

    async def agent(c):
        return await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 3?"}],
                                               tools=[ADD], tool_choice="required")

    (traj,) = to_trajectories(_episode(server, agent), "add", 0, 0, 1.0, 0, {}, tok)
    assert traj.input_ids[traj.prompt_len:] == tok(_call("add"), add_special_tokens=False).input_ids + [
        tok.eos_token_id]
    assert traj.info["resampled"] == 1 and capture_metrics([Outcome([traj])])["agent/resampled"] == 1
    server.stop()


# --- token faithfulness ----------------------------------------------------------------------------------------

def test_non_canonical_sampled_ids_are_trained_as_sampled(tok):
    """The engine spells "Paris" letter by letter, which the tokenizer never would: those ids are what the
    reply's turn trains on, and what the next turn's prompt continues, streamed or not."""
    letters = tok.convert_tokens_to_ids(list("Paris"))
    assert tok.decode(letters) == "Paris" and tok("Paris", add_special_tokens=False).input_ids != letters
    server = serve(StepEngine(tok, letters))
    seen = []

    async def agent(c):
        msgs = [{"role": "user", "content": "The capital of France?"}]
        reply = (await c.chat.completions.create(model="tiny", messages=msgs)).choices[0].message
        seen.append(reply.content)
        msgs += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        seen.append(_text(await _stream(c, model="tiny", messages=msgs)))

    (traj,) = to_trajectories(_episode(server, agent), "t", 0, 0, 1.0, 0, {}, tok)
    assert seen == ["Paris", "Paris"] and traj.info["capture"] == "merged"
    (a, b), (c, d) = traj.turn_spans
    assert traj.input_ids[a:b] == letters + [tok.eos_token_id] == traj.input_ids[c:d]
    assert set(traj.loss_mask[a:b]) == {1} == set(traj.loss_mask[c:d]) and set(traj.loss_mask[b:c]) == {0}
    assert tok(tok.decode(traj.input_ids), add_special_tokens=False).input_ids != traj.input_ids  # not a re-encoding
    server.stop()


# --- log-probs -------------------------------------------------------------------------------------------------

def test_top_logprobs_list_the_likeliest_tokens_streamed_or_not(tiny):
    server = serve(tiny)
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}

    async def main():
        async with client(server) as c:
            greedy = await c.chat.completions.create(temperature=0, **kw)
            sampled = await c.chat.completions.create(temperature=1.0, seed=1, **kw)
            streamed = await _stream(c, temperature=1.0, seed=1, **kw)
            plain = await c.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=1.0, seed=1)
        return greedy, sampled, streamed, plain

    greedy, sampled, streamed, plain = asyncio.run(main())
    assert sampled.choices[0].message.content == plain.choices[0].message.content  # listing them changes no token
    for entry in greedy.choices[0].logprobs.content:  # greedy: the token taken is the likeliest
        (top, *rest) = entry.top_logprobs
        assert len(rest) == 2 and top.token == entry.token and top.logprob == pytest.approx(entry.logprob, abs=1e-4)
    for entry in sampled.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-4
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
    whole = [e for d in _deltas(streamed) if d.logprobs for e in d.logprobs.content]
    assert [e.model_dump() for e in whole] == [e.model_dump() for e in sampled.choices[0].logprobs.content]
    server.stop()


# --- seeds -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_seeded_request_runs_alone_and_repeats(tiny):
    server = serve(tiny)
    batcher = server.endpoint.batcher
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 12, "temperature": 1.0}

    async def main():
        async with client(server) as c:
            first = await c.chat.completions.create(seed=3, **kw)
            batcher.window_s = batcher.max_wait_s = 1.0  # anything that comes within a second could share a batch
            crowd = await asyncio.gather(c.chat.completions.create(seed=3, **kw),
                                         *[c.chat.completions.create(**kw) for _ in range(2)])
            other = await c.chat.completions.create(seed=4, **kw)
        return first, crowd, other

    first, crowd, other = asyncio.run(main())
    assert crowd[0].choices[0].message.content == first.choices[0].message.content
    assert other.choices[0].message.content != first.choices[0].message.content
    assert sorted(batcher.batch_rows[1:3]) == [1, 2]  # the seeded request alone, the other two together
    server.stop()


# --- clients that go away --------------------------------------------------------------------------------------

def test_a_client_that_goes_away_ends_its_rows(tok):
    engine = StepEngine(tok, tok.convert_tokens_to_ids(list("abc")), end=False, step_s=0.01)
    server = serve(engine)
    server.endpoint.sampling = Sampling(max_tokens=2000)  # 20 s of decoding unless it is cancelled
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2000}
    server.call(server.endpoint.open_episode, "gone")
    url = f"{server.episode_url('gone')}/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(10, read=0.3))
    server.wait_idle(10)
    # Gone while its job was queued (on a busy machine: never generated) or while decoding (rows ended early).
    ran = len(engine.lengths)
    assert ran <= 1 and all(lengths[0] < 150 for lengths in engine.lengths)
    assert server.call(server.endpoint.close_episode, "gone").calls == []  # nothing recorded of it
    with httpx.Client(timeout=10) as h, h.stream("POST", f"{server.base_url}/chat/completions",
                                                 json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        assert '"assistant"' in next(lines)  # the role chunk comes at once
        assert next(ln for ln in lines if '"content": "a' in ln)  # then the text, as it is sampled; then it leaves
    server.wait_idle(10)
    assert len(engine.lengths) == ran + 1 and engine.lengths[-1][0] < 150  # it was decoding when it left
    server.stop()


def test_a_hook_that_reads_no_entropy_is_spared_them_and_changes_no_token(tiny):
    seen = {True: [], False: []}

    def hook_for(reads):
        def hook(rows, tokens, logprobs, entropies):
            seen[reads].append(entropies)
            return [False] * len(rows)

        if not reads:
            hook.reads_entropy = False
        return hook

    runs = {reads: tiny.generate([[1, 2, 3]], 2, 6, 1.0, 1.0, 5, stop=hook_for(reads)) for reads in (True, False)}
    assert all(e is not None for e in seen[True]) and seen[False] == [None] * len(seen[False]) != []
    assert [c.token_ids for c in runs[True][0]] == [c.token_ids for c in runs[False][0]]
