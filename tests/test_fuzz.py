"""Bad input, fuzzed with hypothesis: configs, overrides, task params and model replies.

Contract: a bad config is a ``ConfigError`` whose message is one line naming the file (or the override's
key); bad task params are a one-line ``ValueError`` naming the task; any reply scores a float in [0, 1].
Example counts are modest so the file runs in seconds; docs/reliability.md records the totals.
"""

from __future__ import annotations

import copy
import math
import os
import signal
from contextlib import contextmanager

import pytest
import yaml
from conftest import SMOKE
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polyrl.config import ConfigError, TaskConfig, dump_config
from polyrl.config_check import load_config
from polyrl.envs.base import make_task
from polyrl.rewards.code import score_humaneval

# POLYRL_FUZZ_SCALE=20 runs 20x the examples with a random seed (a deeper local search); CI runs the fixed,
# derandomized default so a red build is reproducible.
SCALE = int(os.environ.get("POLYRL_FUZZ_SCALE", "1"))


def fuzz(n: int) -> settings:
    return settings(max_examples=n * SCALE, deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.too_slow])


FUZZ = fuzz(60)
BASE = yaml.safe_load(dump_config(load_config(SMOKE)))


def _paths(node, prefix=""):
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        out += [path, *_paths(value, path)]
    return out


PATHS = _paths(BASE)  # every key of a full config, e.g. "rollout.group_size", "tasks.0.params.min_terms"
KEY_WORDS = sorted({p.rsplit(".", 1)[-1] for p in PATHS})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.integers(), st.floats(),
    st.text(max_size=12), st.sampled_from(["grpo", "ppo_clip", "tiny-random", "chain_sum", "k3", "1e-3", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(KEY_WORDS), st.text(max_size=6), st.integers(-2, 2)), inner,
                        max_size=3),
    ),
    max_leaves=6,
)
DELETE = object()


def _set(data, path, value):
    """Best effort: walk/create ``path`` and set (or delete) the value there; odd structure is left odd."""
    parts, node = path.split("."), data
    for part in parts[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            return
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value if value is not DELETE else None
    elif isinstance(node, dict):
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value


def _assert_one_line(err: Exception, *prefixes: str) -> None:
    message = str(err)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    assert message.startswith(prefixes), f"{message!r} names neither the file nor the key"


@contextmanager
def time_limit(seconds: int):
    """A hang is a finding too: SIGALRM turns it into an exception the test reports."""

    def fire(signum, frame):
        raise TimeoutError(f"no answer within {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- configs ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@FUZZ
@given(st.lists(st.tuples(st.sampled_from([*PATHS, "bogus", "tasks.3.name", "model.lora.r"]),
                          st.one_of(values, st.just(DELETE))), min_size=1, max_size=4))
def test_mutated_configs_fail_only_with_config_error(tmp_path_factory, mutations):
    data = copy.deepcopy(BASE)
    for path, value in mutations:
        _set(data, path, value)
    path = tmp_path_factory.getbasetemp() / "mutated.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        load_config(path)
    except ConfigError as err:
        _assert_one_line(err, str(path))


# Text made of YAML's punctuation and the config's own key words, so it often parses into odd structures.
yamlish = st.lists(st.sampled_from([*":-[]{},#&*!|>'\"%@`?~ \n\tab01.", *KEY_WORDS, ": ", "\n  ", "- "]),
                   max_size=30).map("".join)


BOMB = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n".encode()
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
) + b"tasks: *i\n"


@pytest.mark.slow
@FUZZ
@given(st.one_of(st.binary(max_size=120), st.text(max_size=120).map(str.encode), yamlish.map(str.encode)))
@example(b"\x80")  # not UTF-8
@example(b"[" * 5000)  # deeply nested
@example(b"tasks: " + b"[" * 200 + b"]" * 200)
@example(BOMB)  # "billion laughs": 9^9 references through aliases
def test_raw_config_files_fail_only_with_config_error(tmp_path_factory, content):
    path = tmp_path_factory.getbasetemp() / "raw.yaml"
    path.write_bytes(content)
    try:
        load_config(path)
    except ConfigError as err:
        _assert_one_line(err, str(path))


@FUZZ
@given(st.lists(st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from([*PATHS, "tasks.0.name.x", "a..b", "", "tasks.-1"]),
              st.one_of(yamlish, st.text(max_size=10))),
    st.text(max_size=20),
), min_size=1, max_size=3))
@example(["tasks=[1]", "tasks.0.x=1"])  # a path through a list item that is a plain value
@example(["rollout.group_size=[unclosed"])  # a value that is not YAML
def test_overrides_fail_only_with_config_error(overrides):
    try:
        load_config(SMOKE, overrides)
    except ConfigError as err:
        _assert_one_line(err, str(SMOKE), "override '")


def test_config_as_data_of_the_wrong_shape():
    for data in ([], "text", 3, None, {"tasks": None}, {"tasks": [[]]}, {1: 2}):
        with pytest.raises(ConfigError) as err:
            load_config(None, data=data if data is not None else {})
        _assert_one_line(err.value, "config")


# --- task params ------------------------------------------------------------------------------------------

RG_FIELDS = {
    "chain_sum": ["min_terms", "max_terms", "min_digits", "max_digits", "allow_negation", "seed", "size"],
    "basic_arithmetic": ["min_terms", "max_terms", "operators", "allow_parentheses", "format_style"],
    "word_sorting": ["min_words", "max_words", "min_word_length", "max_word_length", "transformation"],
    "spell_backward": ["min_word_len", "max_word_len", "data_file"],
}
# Mostly plausible values for real fields (so the dataset's own checks run), some plain garbage.
small = st.one_of(
    st.integers(-3, 12), st.integers(-3, 12), st.booleans(), st.none(), st.floats(-3, 12), st.text(max_size=5),
    st.lists(st.integers(-2, 5), max_size=3), st.sampled_from(["+", "-*", "simple", "lowercase", "/nonexistent"]),
)
task_params = st.sampled_from(sorted(RG_FIELDS)).flatmap(lambda name: st.tuples(
    st.just(name),
    st.dictionaries(st.one_of(st.sampled_from(RG_FIELDS[name]), st.sampled_from(RG_FIELDS[name]),
                              st.text(max_size=5)), small, max_size=3),
))


@pytest.mark.slow
@fuzz(100)
@given(task_params)
@example(("spell_backward", {"min_word_len": 5, "max_word_len": 2}))  # the dataset's own assertion
@example(("spell_backward", {"data_file": "/nonexistent"}))  # a file that is not there
@example(("chain_sum", {"min_digits": 0}))
@example(("chain_sum", {"seed": 3}))  # clashes with the seed polyrl passes
def test_garbage_task_params_fail_with_one_line(case):
    name, params = case
    try:
        with time_limit(10):
            task = make_task(TaskConfig(name=name, params=params, eval_size=2), seed=0)
            task.train_item(0)
            task.eval_items(1)
    except ValueError as err:
        _assert_one_line(err, f"task '{name}'", "task.params", "task:")
        assert name in str(err) or "params" in str(err)


# --- model replies ----------------------------------------------------------------------------------------

def _tasks():
    specs = [
        ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "last_number"),
        ("chain_sum", {}, "full"),
        ("basic_arithmetic", {}, "full"),
        ("word_sorting", {}, "full"),
        ("spell_backward", {}, "full"),
    ]
    return [make_task(TaskConfig(name=n, params=p, answer=a, eval_size=1), seed=0) for n, p, a in specs]


TASKS = _tasks()
garbage = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=50),
    st.from_regex(r"-?[\d,.]{1,40}", fullmatch=True),
    st.builds(lambda a, n: f"{a} {n}", st.text(max_size=30), st.integers()),
    st.builds(lambda n: "9" * n, st.integers(300, 5000)),  # numbers too long for float()/int() limits
)


@fuzz(150)
@given(st.integers(0, len(TASKS) - 1), st.integers(0, 50), garbage, st.booleans())
def test_any_reply_scores_a_float_in_unit_interval(which, index, reply, embed_answer):
    task = TASKS[which]
    item = task.train_item(index)
    if embed_answer:  # the right answer buried in garbage must not break the scorer either
        reply = f"{reply}{item['answer']}{reply[::-1]}"
    score = task.score(item, reply)
    assert isinstance(score, float) and not math.isnan(score) and 0.0 <= score <= 1.0


@pytest.mark.slow
@fuzz(12)
@given(st.one_of(st.text(max_size=80), st.text(alphabet=st.characters(codec=None), max_size=20),
                 st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))))
@example("\ud800 lone surrogate")
def test_garbage_code_completions_get_a_verdict(completion):
    score = score_humaneval("HumanEval/0", completion, timeout_s=5)
    assert score.reward in (0.0, 1.0) and score.verdict.status != "error", score.verdict
