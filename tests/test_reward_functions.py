"""Your reward: functions in the four conventions (one reply, a batch, TRL's, verl's), sync or async, dict
returns as named terms, failures that score 0 with the error's first line, the built-in checkers, config
errors in one line, and the reward audit before step 1."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from polyrl.config import ConfigError, TaskConfig
from polyrl.config_check import load_config
from polyrl.data.files import RowError
from polyrl.envs import make_task
from polyrl.envs.reward_audit import audit_task, audit_tasks
from polyrl.rewards.functions import RewardFn, Sample, reward_error_metrics

TINY = {"model": {"name": "tiny-random", "bf16": False}, "logging": {"progress": False, "tensorboard": False,
                                                                     "report": False}}

REWARDS = '''
import asyncio
import json
import re
import time
from pathlib import Path


def _seen(name, value):
    Path(__file__).with_name(f"seen_{name}.json").write_text(json.dumps(value))


def single(completion, item):
    return 1.0 if completion.strip() == str(item["answer"]) else 0.0


def batched(completions, items):
    _seen("batched", len(completions))
    return [1.0 if c.strip() == str(i["answer"]) else 0.0 for c, i in zip(completions, items)]


def trl(prompts, completions, answer, **kwargs):
    _seen("trl", {"prompts": prompts, "completions": completions, "answer": answer, "kwargs": kwargs})
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(contents, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _seen("verl", {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                   "extra_info": extra_info})
    return 1.0 if solution_str.strip() == ground_truth else 0.0


async def async_single(completion, item):
    if completion == "hang":
        await asyncio.sleep(60)
    await asyncio.sleep(0.01)
    return single(completion, item)


async def async_batched(completions, items):
    await asyncio.sleep(0.01)
    return [2.0 * single(c, i) for c, i in zip(completions, items)]


def terms(completion, item):
    return {"correct": single(completion, item), "short": 0.5 if len(completion) < 5 else 0.0, "note": "dropped"}


def with_reward_key(completion, item):
    return {"reward": 0.25, "bonus": 1.0}


def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": solution_str}


def raises(completion, item):
    if completion == "boom":
        raise ValueError("a bad reply\\nsecond line of the message")
    return 1.0


def hangs(completion, item):
    if completion == "hang":
        time.sleep(60)
    return 1.0


def nan(completion, item):
    return float("nan") if completion == "nan" else 1.0


def text(completion, item):
    return "yes"


def zero(completion, item):
    return 0.0


def one(completion, item):
    return 1.0


def question_number(completion, item):
    """Reads the wrong field: the question's last number, not the answer."""
    want = re.findall(r"[0-9]+", item["question"])[-1]
    return 1.0 if completion.strip() == want else 0.0


def any_number(completion, item):
    return 1.0 if re.search(r"[0-9]", completion) else 0.0


def wrong_key(completion, item):
    return 1.0 if completion.strip() == item["solution"] else 0.0


def gsm8k(completion, item):
    match = re.search(r"#### *(-?[0-9.,]+)", completion)
    return 1.0 if match is not None and match.group(1).replace(",", "") == item["answer"] else 0.0


def reward_func(queries, prompts, labels):
    _seen("openrlhf", {"queries": queries, "prompts": prompts, "labels": labels})
    return [1.0 if q.endswith(str(label)) else 0.0 for q, label in zip(queries, labels)]


def noisy(completion, item):
    print("debugging output from the reward", completion)
    return 1.0


def one_arg(completion):
    return 1.0


NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def ref(rewards: Path, name: str) -> str:
    return f"{rewards}:{name}"


def seen(rewards: Path, name: str):
    return json.loads(rewards.with_name(f"seen_{name}.json").read_text())


def s(completion: str, answer="4", **item) -> Sample:
    return Sample(completion, {"answer": answer, **item}, answer, "What is 2+2?")


def rewards_of(scored) -> list[float]:
    return [x.reward for x in scored]


# --- 5. conventions ------------------------------------------------------------------------------------------


def test_one_reply_at_a_time_and_batched_functions(rewards):
    single = RewardFn(ref(rewards, "single"), timeout_s=10)
    batched = RewardFn(ref(rewards, "batched"), timeout_s=10)
    try:
        assert (single.convention, single.batched, batched.convention, batched.batched) == (
            "single", False, "batched", True)
        samples = [s("4"), s(" 4 "), s("5"), s("")]
        assert rewards_of(single.score(samples)) == rewards_of(batched.score(samples)) == [1.0, 1.0, 0.0, 0.0]
        assert seen(rewards, "batched") == 4  # one call for the batch
        assert all(x.error is None and x.terms == {} for x in single.score(samples))
        assert single.score([]) == []
    finally:
        single.close()
        batched.close()


def test_trl_rewards_get_columns_as_lists_and_conversational_completions(rewards):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "answer": str(2 * i), "id": i}
            for i in range(3)]
    task = make_task(TaskConfig(name="t", items=rows, reward=ref(rewards, "trl"), held_out_fraction=0.0), 0)
    assert task.reward.convention == "trl"
    envs = [task.make_env() for _ in rows]
    for env, row in zip(envs, rows, strict=True):
        assert env.reset(row) == row["prompt"]
    results = task.step_many(envs, ["0", "3", "4"])
    assert [r.reward for r in results] == [1.0, 0.0, 1.0] and all(r.done for r in results)
    got = seen(rewards, "trl")
    assert got["prompts"] == [row["prompt"] for row in rows]
    assert got["completions"] == [[{"role": "assistant", "content": c}] for c in ["0", "3", "4"]]
    assert got["answer"] == ["0", "2", "4"] and got["kwargs"] == {"id": [0, 1, 2]}

    # TRL's standard (non-conversational) format: a text prompt column, text completions
    text_rows = [{"prompt": "Say 7.", "answer": "7", "source": "a"}, {"prompt": "Say 8.", "answer": "8", "source": "b"}]
    text_task = make_task(TaskConfig(name="t2", items=text_rows, reward=ref(rewards, "trl"), held_out_fraction=0.0),
                          0)
    envs = [text_task.make_env() for _ in text_rows]
    assert [e.reset(r) for e, r in zip(envs, text_rows, strict=True)][1] == [{"role": "user", "content": "Say 8."}]
    assert [r.reward for r in text_task.step_many(envs, ["7", "7"])] == [1.0, 0.0]
    got = seen(rewards, "trl")
    assert got["prompts"] == ["Say 7.", "Say 8."] and got["completions"] == ["7", "7"]
    assert got["kwargs"] == {"source": ["a", "b"]}
    task.reward.close()
    text_task.reward.close()


def test_verl_compute_score_gets_the_ground_truth_from_reward_model(rewards):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(10 + i)}, "extra_info": {"split": "train",
                                                                                              "index": i}}
            for i in range(2)]
    task = make_task(TaskConfig(name="v", items=rows, reward=ref(rewards, "compute_score"),
                                held_out_fraction=0.0), 0)
    assert task.reward.convention == "verl"
    env = task.make_env()
    env.reset(rows[1])
    assert env.step("11").reward == 1.0
    assert seen(rewards, "verl") == {
        "data_source": "openai/gsm8k", "solution_str": "11", "ground_truth": "11",
        "extra_info": {"split": "train", "index": 1}}
    env.reset(rows[0])
    assert env.step("11").reward == 0.0
    task.reward.close()


def test_openrlhf_reward_func_gets_queries_prompts_and_labels(rewards):
    fn = RewardFn(ref(rewards, "reward_func"), timeout_s=10)
    try:
        assert fn.convention == "openrlhf" and fn.batched
        assert rewards_of(fn.score([s("4"), s("5")])) == [1.0, 0.0]
        assert seen(rewards, "openrlhf") == {"queries": ["What is 2+2?4", "What is 2+2?5"],
                                             "prompts": ["What is 2+2?", "What is 2+2?"], "labels": ["4", "4"]}
    finally:
        fn.close()


def test_what_a_reward_prints_does_not_break_its_replies(rewards):
    fn = RewardFn(ref(rewards, "noisy"), timeout_s=10)
    try:
        scored = fn.score([s("a"), s("b")])
        assert rewards_of(scored) == [1.0, 1.0] and all(x.error is None for x in scored)
    finally:
        fn.close()


@pytest.mark.slow
def test_async_functions_single_and_batched(rewards):
    single = RewardFn(ref(rewards, "async_single"), timeout_s=1)
    batched = RewardFn(ref(rewards, "async_batched"), timeout_s=10)
    try:
        assert single.is_async and batched.is_async and batched.convention == "batched"
        assert rewards_of(single.score([s("4"), s("5"), s("4")])) == [1.0, 0.0, 1.0]
        assert rewards_of(batched.score([s("4"), s("5")])) == [2.0, 0.0]
        # an async reply that hangs times out on its own; the replies beside it keep their scores
        t0 = time.perf_counter()
        scored = single.score([s("4"), s("hang"), s("4")])
        assert time.perf_counter() - t0 < 20  # not the 60 s it would sleep
        assert rewards_of(scored) == [1.0, 0.0, 1.0]
        assert scored[1].error.startswith("TimeoutError") and scored[0].error is None
    finally:
        single.close()
        batched.close()


def test_dict_returns_are_named_terms_and_a_total(rewards):
    fn = RewardFn(ref(rewards, "terms"), timeout_s=10)
    keyed = RewardFn(ref(rewards, "with_reward_key"), timeout_s=10)
    verl = RewardFn(ref(rewards, "verl_dict"), timeout_s=10)
    try:
        right, wrong = fn.score([s("4"), s("a long wrong reply")])
        assert (right.reward, right.terms) == (1.5, {"correct": 1.0, "short": 0.5})  # the sum; text is dropped
        assert (wrong.reward, wrong.terms) == (0.0, {"correct": 0.0, "short": 0.0})
        assert keyed.score([s("x")])[0].reward == 0.25  # a "reward" entry is the total
        right, wrong = verl.score([s("4"), s("5")])
        assert (right.reward, right.terms) == (1.0, {"score": 1.0, "acc": 1.0})  # verl's "score" wins
        assert (wrong.reward, wrong.terms) == (-1.0, {"score": -1.0, "acc": 0.0})
    finally:
        fn.close()
        keyed.close()
        verl.close()


def test_a_raise_scores_zero_with_the_first_line_and_a_task_reports_it(rewards):
    rows = [{"question": "q", "answer": "4"}]
    task = make_task(TaskConfig(name="r", items=rows, reward=ref(rewards, "raises"), held_out_fraction=0.0), 0)
    scored = task.reward.score([s("fine"), s("boom"), s("fine")])
    assert rewards_of(scored) == [1.0, 0.0, 1.0]
    assert scored[1].error == "ValueError: a bad reply" and scored[0].error is None
    envs = [task.make_env(), task.make_env()]
    for env in envs:
        env.reset(rows[0])
    good, bad = task.step_many(envs, ["fine", "boom"])
    assert "reward_error" not in good.info and bad.info["reward_error"] == "ValueError: a bad reply"
    assert (bad.reward, bad.info["score"]) == (0.0, 0.0)
    trajectories = [SimpleNamespace(info=r.info) for r in (good, bad, bad)]
    assert reward_error_metrics(trajectories) == {"reward/errors": 2.0}
    assert reward_error_metrics([SimpleNamespace(info=good.info)]) == {}
    task.reward.close()


@pytest.mark.slow
def test_a_reward_that_hangs_times_out_and_the_next_call_works(rewards):
    fn = RewardFn(ref(rewards, "hangs"), timeout_s=1)
    try:
        t0 = time.perf_counter()
        scored = fn.score([s("a"), s("hang"), s("b")])
        assert time.perf_counter() - t0 < 20  # not the 60 s it would sleep
        assert rewards_of(scored) == [1.0, 0.0, 1.0]
        assert scored[1].error == "TimeoutError: ran past reward_timeout_s (1 s)"
        again = fn.score([s("c"), s("d")])  # a fresh process after the hung one was killed
        assert rewards_of(again) == [1.0, 1.0] and all(x.error is None for x in again)
    finally:
        fn.close()


def test_nan_and_non_numbers_are_errors(rewards):
    nan = RewardFn(ref(rewards, "nan"), timeout_s=10)
    text = RewardFn(ref(rewards, "text"), timeout_s=10)
    try:
        ok, bad = nan.score([s("fine"), s("nan")])
        assert ok.reward == 1.0 and bad.reward == 0.0 and bad.error == "ValueError: the reward is nan"
        (scored,) = text.score([s("x")])
        assert scored.reward == 0.0 and scored.error == "TypeError: the reward is a str, not a number"
    finally:
        nan.close()
        text.close()


# --- built-in checkers ---------------------------------------------------------------------------------------


def test_numeric_tolerance_and_relative():
    absolute = RewardFn("numeric", {"tolerance": 0.01})
    assert rewards_of(absolute.score([s("about 3.005", "3"), s("3.02", "3"), s("no number", "3"),
                                       s("1,000.004", "1000")])) == [1.0, 0.0, 0.0, 1.0]
    relative = RewardFn("numeric", {"relative": 0.05})
    assert rewards_of(relative.score([s("104", "100"), s("106", "100")])) == [1.0, 0.0]
    strict = RewardFn("numeric")
    assert rewards_of(strict.score([s("3.0", "3"), s("3.001", "3")])) == [1.0, 0.0]


def test_exact_ignore_case_last_number_regex_and_math_verify():
    assert rewards_of(RewardFn("exact").score([s(" Paris ", "Paris"), s("paris", "Paris")])) == [1.0, 0.0]
    assert rewards_of(RewardFn("exact", {"ignore_case": True}).score([s("paris", "PARIS"), s("", "")])) == [1.0, 0.0]
    assert rewards_of(RewardFn("last_number").score([s("1 then 1,234", "1234"), s("12", "1234")])) == [1.0, 0.0]
    regex = RewardFn("regex", {"pattern": r"^#### {answer}$"})
    assert rewards_of(regex.score([s("#### 1.5", "1.5"), s("#### 1x5", "1.5"), s("1.5", "1.5")])) == [1.0, 0.0, 0.0]
    math_verify = RewardFn("math_verify")
    assert rewards_of(math_verify.score([s("So \\boxed{1/2}", "0.5"), s("\\boxed{1/3}", "0.5")])) == [1.0, 0.0]


# --- config errors: one line naming the key ---------------------------------------------------------------


def _config_error(task: dict) -> str:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(4)]
    with pytest.raises(ConfigError) as err:
        load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": rows, **task}]})
    message = str(err.value)
    assert "\n" not in message
    return message


def test_reward_config_errors_are_one_line(rewards):
    assert "tasks.0.reward: no module named 'yourreward_nosuch'" in _config_error(
        {"reward": "yourreward_nosuch:score"})
    assert "tasks.0.reward: no such file 'nowhere/rewards.py'" in _config_error({"reward": "nowhere/rewards.py:f"})
    assert "has no attribute 'missing'" in _config_error({"reward": ref(rewards, "missing")})
    message = _config_error({"reward": ref(rewards, "one_arg")})
    assert f"tasks.0.reward: '{ref(rewards, 'one_arg')}' takes (completion); a reward takes" in message
    assert "(completion, item)" in message and "verl's (data_source, solution_str" in message
    assert "is not callable" in _config_error({"reward": ref(rewards, "NOT_CALLABLE")})
    message = _config_error({"reward": "exactly"})
    assert "tasks.0.reward: unknown reward 'exactly'; built-in: " in message and "math_verify" in message
    assert "tasks.0.reward_params: settings are for built-in rewards" in _config_error(
        {"reward": ref(rewards, "single"), "reward_params": {"tolerance": 0.1}})
    assert "tasks.0.reward_params: set for no reward" in _config_error({"reward_params": {"tolerance": 0.1}})


def test_a_bad_reward_param_names_the_reward_params_key():
    """The config key is tasks[].reward_params (there is no tasks[].reward.params)."""
    message = _config_error({"reward": "regex", "reward_params": {"pattern": "(unclosed"}})
    assert "tasks.0.reward_params.pattern: not a regular expression (missing ), unterminated subpattern" in message
    assert "tasks.0.reward_params.pattern: required" in _config_error({"reward": "regex"})
    assert "tasks.0.reward_params.tolerance: expected float, got 'small'" in _config_error(
        {"reward": "numeric", "reward_params": {"tolerance": "small"}})
    assert "tasks.0.reward_params.tol: unknown; valid: tolerance, relative" in _config_error(
        {"reward": "numeric", "reward_params": {"tol": 0.1}})


def test_reward_on_a_reasoning_gym_task_is_an_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, data={**TINY, "tasks": [{"name": "chain_sum", "reward": "exact"}]})
    message = str(err.value)
    assert "tasks.0.reward: the env 'reasoning_gym' scores its own episodes" in message and "\n" not in message
    assert "reward_components: [{reward: exact}]" in message


def test_reward_components_mix_named_rewards_into_another_envs_reward(rewards, tok):
    from polyrl.envs.reward_mix import RewardMixer
    from polyrl.types import Trajectory

    cfg = load_config(None, data={**TINY, "tasks": [{"name": "chain_sum", "reward_components": [
        {"kind": "env", "weight": 1.0}, {"reward": "numeric", "params": {"tolerance": 0.5}, "weight": 0.5},
        {"reward": ref(rewards, "single"), "weight": 2.0}]}]})
    task = make_task(cfg.tasks[0], 0)
    item = {**task.train_item(0), "answer": "12"}
    prompt = tok("What is 5 + 7?", add_special_tokens=False).input_ids

    def trajectory(reply: str, env_reward: float) -> Trajectory:
        ids = prompt + tok(reply, add_special_tokens=False).input_ids
        n, p = len(ids), len(prompt)
        return Trajectory("chain_sum", 0, 0, ids, [0] * p + [1] * (n - p), [0.0] * n, [0] * n, reward=env_reward)

    right, close, wrong = trajectory("12", 1.0), trajectory("12.3", 0.0), trajectory("7", 0.0)
    mixer = RewardMixer({"chain_sum": task}, tok, "tiny-random")
    mixer.apply([right, close, wrong], {0: item})
    assert right.rewards == {"env": 1.0, "numeric": 1.0, "single": 1.0} and right.reward == 3.5
    assert close.rewards == {"env": 0.0, "numeric": 1.0, "single": 0.0} and close.reward == 0.5
    assert wrong.rewards == {"env": 0.0, "numeric": 0.0, "single": 0.0} and wrong.reward == 0.0
    for fn in mixer.functions.values():
        fn.close()


def test_a_bad_reward_component_fails_when_the_config_loads():
    """As tasks[].reward does: not at the first step's reward, after the model loaded and evaluated."""
    for component in ({"reward": "exactly"}, {"reward": "yourreward_nosuch_component:score"},
                      {"reward": "regex", "params": {"pattern": "(unclosed"}}):
        with pytest.raises(ConfigError, match=r"tasks\.0\.reward_components") as err:
            load_config(None, data={**TINY, "tasks": [{"name": "chain_sum",
                                                       "reward_components": [{"kind": "env"}, component]}]})
        assert "\n" not in str(err.value)


# --- 6. the audit --------------------------------------------------------------------------------------------


def _audit_task(tmp_path: Path, reward: str, rows: list[dict] | None = None, **config):
    rows = rows or [{"question": f"What is {1 + i % 2} times {i + 3}?", "answer": str((1 + i % 2) * (i + 3))}
                    for i in range(20)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_task(TaskConfig(name="qa", items=str(path), reward=reward, held_out_fraction=0.0, **config), 0), path


@pytest.mark.parametrize(("reward", "problem"), [
    ("zero", "every reply scored 0, reference answers too (e.g. {path}: line "),
    ("one", "an empty reply scored the top reward 1 on 16 of 16 rows ({path}: line "),
    ("question_number", "reference answers scored below the top reward 1 on "),
    ("any_number", "another row's answer scored the top reward 1 on 16 of 16 rows ({path}: line "),
    ("wrong_key", "the reward raised on reference replies ({path}: line "),
])
def test_the_audit_stops_a_broken_reward_with_one_line_naming_rows(reward, problem, rewards, tmp_path):
    task, path = _audit_task(tmp_path, ref(rewards, reward))
    result = audit_task(task)
    assert not result.passed and result.rows == 16
    line = result.line()
    assert "\n" not in line and line.startswith("task 'qa': reward audit failed: ")
    assert problem.format(path=path) in line, line
    assert re.search(re.escape(str(path)) + r": line \d+", line)
    with pytest.raises(ValueError) as err:
        audit_tasks({"qa": task}, log=lambda m: pytest.fail(m))
    assert str(err.value) == line
    task.reward.close()


def test_the_wrong_field_reward_names_the_rows_it_got_wrong(rewards, tmp_path):
    task, path = _audit_task(tmp_path, ref(rewards, "question_number"))
    result = audit_task(task)
    wrong = [where for where, reference, _, _ in result.table if reference < 1.0]
    assert 0 < len(wrong) < 16
    assert f"on {len(wrong)} of 16 rows ({wrong[0]}: reply" in result.line()
    task.reward.close()


def test_the_audit_passes_a_correct_reward(rewards, tmp_path):
    task, path = _audit_task(tmp_path, ref(rewards, "single"))
    logged: list[str] = []
    (result,) = audit_tasks({"qa": task}, log=logged.append)
    assert result.passed and logged == [result.line()]
    assert logged[0] == ("task 'qa': reward audit passed on 16 rows (reference replies score 1; empty replies and "
                         "other rows' answers score less)")
    assert all(where.startswith(f"{path}: line ") and (ref_, empty, other) == (1.0, 0.0, 0.0)
               for where, ref_, empty, other in result.table)
    task.reward.close()
    builtin, _ = _audit_task(tmp_path, "last_number")
    assert audit_task(builtin).passed


def test_audit_reply_formats_the_reference_for_a_gsm8k_style_reward(rewards, tmp_path):
    plain, _ = _audit_task(tmp_path, ref(rewards, "gsm8k"))
    assert "every reply scored 0" in audit_task(plain).line()
    task, _ = _audit_task(tmp_path, ref(rewards, "gsm8k"), audit={"reply": "Working... #### {answer}"})
    result = audit_task(task)
    assert result.passed, result.line()
    builtin, _ = _audit_task(tmp_path, "regex", reward_params={"pattern": "#### {answer}$"},
                             audit={"reply": "#### {answer}"})
    assert audit_task(builtin).passed
    bad, _ = _audit_task(tmp_path, "exact", audit={"reply": "{nope}"})
    with pytest.raises(ValueError, match=r"audit.reply cannot be filled from a row \(KeyError"):
        audit_task(bad)
    plain.reward.close()
    task.reward.close()


def test_audit_false_skips_the_audit_and_the_answer_check(rewards, tmp_path):
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": [{"question": "q", "answer": "1"}] * 4,
                                                     "reward": ref(rewards, "zero"), "audit": False}]})
    assert cfg.tasks[0].audit.enabled is False
    task = make_task(cfg.tasks[0], 0)
    assert audit_tasks({"qa": task}, log=lambda m: pytest.fail(m)) == []
    # a reward that needs no reference: rows without answers are fine once the audit is off
    rows = [{"question": f"Write a haiku {i}"} for i in range(4)]
    open_ended = make_task(TaskConfig(name="h", items=rows, reward="regex", reward_params={"pattern": "\\n"},
                                      audit=False, held_out_fraction=0.0), 0)
    envs = [open_ended.make_env(), open_ended.make_env()]
    for env in envs:
        env.reset(rows[0])
    assert [r.reward for r in open_ended.step_many(envs, ["a\nb", "one line"])] == [1.0, 0.0]
    with pytest.raises(RowError, match="no field 'answer'"):
        make_task(TaskConfig(name="h", items=rows, reward="regex", reward_params={"pattern": "\\n"},
                             held_out_fraction=0.0), 0)
    task.reward.close()


def test_audit_rows_sets_how_many_rows_are_checked(rewards, tmp_path):
    task, _ = _audit_task(tmp_path, ref(rewards, "single"), audit={"rows": 4})
    result = audit_task(task)
    assert result.passed and result.rows == 4 and len(result.table) == 4
    assert [where for where, *_ in result.table] == [task.source.train_where(i) for i in range(4)]
    task.reward.close()
