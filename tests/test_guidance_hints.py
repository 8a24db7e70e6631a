"""Hints for all-fail groups (``guidance.hint_fraction``, GHPO / QuestA): the hint text and its schedule by hand,
the hinted prompt, and whole sampling rounds on the smoke run with a scripted rollout function that solves an
item only when its prompt carries a hint."""

import pytest
from conftest import SMOKE
from test_guidance import SUM

from polyrl.config import ConfigError, GuidanceConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import make_task
from polyrl.rollout.multi_turn import start_episode, to_trajectory
from polyrl.train.demonstrations import play_replies
from polyrl.train.hints import HINT_SEED_OFFSET, hint_fraction, hint_text, hinted_task, reference_hint
from polyrl.train.step import build_run, produce_batch, step_metrics

TEMPLATE = GuidanceConfig().hint_template


def test_hint_text_worked_by_hand():
    assert hint_text("-4", 0.5) == "-"  # floor(0.5 x 2) = 1 character
    assert hint_text("7", 0.5) == ""  # floor(0.5 x 1) = 0: no hint
    assert hint_text("12345", 0.5) == "12"  # one word: cut anywhere
    # Several words: "The answer is 42"[:8] is "The answ", cut back to the last whitespace.
    assert hint_text("The answer is 42", 0.5) == "The"
    assert hint_text("The answer is 42", 0.75) == "The answer"  # [:12] "The answer i"
    assert hint_text("ab cd", 0.4) == "ab"  # [:2] ends at a word's end: nothing to cut
    assert hint_text("ab cd", 0.6) == "ab"  # [:3] "ab " loses its trailing space
    assert hint_text("abcdef gh", 0.5) == ""  # [:4] is inside the first word: no whole word to give
    assert hint_text("a" * 100, 0.29) == "a" * 29  # not 28: 0.29 x 100 is 28.999... in floating point
    assert hint_text("-4", 0.0) == ""


def test_hint_fraction_anneals_linearly_to_zero_with_the_step():
    c = GuidanceConfig(hint_fraction=0.6, hint_anneal_steps=10)
    assert [hint_fraction(c, s) for s in (1, 6, 11, 50)] == pytest.approx([0.6, 0.3, 0.0, 0.0])
    assert [hint_fraction(GuidanceConfig(hint_fraction=0.6), s) for s in (1, 1000)] == [0.6, 0.6]


@pytest.fixture(scope="module")
def task(tok):
    return make_task(TaskConfig(**SUM), seed=0, tokenizer=tok)


def test_the_hinted_prompt_carries_the_hint_and_the_task_is_otherwise_the_same(task, tok):
    item = task.train_item(0)  # 0 - 4 = -4
    hint = TEMPLATE.format(hint="-")
    hinted = hinted_task(task, hint)
    plain_ep, hinted_ep = (start_episode(t, 0, item, 0, tok) for t in (task, hinted))
    assert hinted_ep.messages[-1]["content"] == plain_ep.messages[-1]["content"] + hint
    assert "Hint:" not in plain_ep.messages[-1]["content"]
    assert hint in tok.decode(hinted_ep.ids) and "Hint:" not in tok.decode(plain_ep.ids)
    assert "Hint:" not in start_episode(task, 0, item, 0, tok).messages[-1]["content"]  # the task is untouched
    # Items, name and reference are the task's; the env still scores the reply, not the hint.
    assert hinted.name == task.name and hinted.train_item(0) == item and hinted.reference_reply(item) == "-4"
    assert play_replies(hinted_ep, ["-4"], tok) is None


def test_a_hint_needs_a_reference_the_env_scores_a_success(task, tok):
    item = task.train_item(0)
    assert reference_hint(task, 0, item, 0.5, tok) == "-"
    assert reference_hint(task, 0, item, 0.4, tok) == ""  # floor(0.4 x 2) = 0
    wrong = make_task(TaskConfig(**SUM, reference="{answer}1"), seed=0, tokenizer=tok)  # "-41": never hinted
    assert reference_hint(wrong, 0, item, 0.5, tok) == ""
    agent = object.__new__(AgentTask)  # no setup needed: an agent task is refused before anything is read
    assert reference_hint(agent, 0, item, 0.5, tok) == ""


@pytest.mark.parametrize("override, key", [
    ("guidance.hint_fraction=1.0", "guidance.hint_fraction"),
    ("guidance.hint_fraction=-0.1", "guidance.hint_fraction"),
    ("guidance.hint_anneal_steps=-1", "guidance.hint_anneal_steps"),
    ("guidance.hint_template=Hint without a field", "guidance.hint_template"),
    ("guidance.hint_template=Hint {hint} and {other}", "guidance.hint_template"),
    ("guidance.hint_template=Hint {hint} {hint}", "guidance.hint_template"),
])
def test_config_errors_are_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, [override])
    message = str(err.value)
    assert f"smoke.yaml: {key}:" in message and "\n" not in message


def test_hints_need_engines_that_get_the_hinted_task():
    with pytest.raises(ConfigError, match="guidance.hint_fraction: .*disaggregated"):
        load_config(SMOKE, ["guidance.hint_fraction=0.5", "runtime.kind=ray", "runtime.engines=disaggregated"])
    custom = load_config(SMOKE, ['guidance.hint_template="\\nStart: {hint}"', "guidance.hint_fraction=0.5"])
    assert custom.guidance.hint_template == "\nStart: {hint}"


class ScriptedRollout:
    """``rollout_fn``: each sample replies ``x`` (a failure), except the first of a group whose prompt carries
    a hint and ``solve_hinted``, which replies the item's reference (a success). Records each call."""

    def __init__(self, tok, solve_hinted: bool = True) -> None:
        self.tok, self.solve_hinted, self.calls = tok, solve_hinted, []

    def __call__(self, requests, seed, version, first_id):
        self.calls.append(([index for _, index, _ in requests], seed, first_id))
        out = []
        for g, (task, index, item) in enumerate(requests):
            for k in range(4):  # the smoke run's group_size
                episode = start_episode(task, index, item, first_id + g, self.tok)
                hinted = "Hint:" in episode.messages[-1]["content"]
                reply = task.reference_reply(item) if hinted and self.solve_hinted and k == 0 else "x"
                play_replies(episode, [reply], self.tok)
                out.append(to_trajectory(episode, self.tok))
        return out


def _run(tmp_path, *overrides):
    return build_run(load_config(SMOKE, ["logging.tensorboard=false", *overrides]), tmp_path)


def test_an_all_fail_group_is_sampled_again_with_a_hint_and_trained(tmp_path, tok):
    run = _run(tmp_path, "guidance.hint_fraction=0.5", "algorithm.sampling.dynamic=true",
               "algorithm.sampling.max_extra_rounds=0")
    rollout = ScriptedRollout(tok)
    batch = produce_batch(run, 1, rollout_fn=rollout)
    # Step 1 draws items 0 ("-4", hint "-") and 1 ("3", nothing to reveal at 0.5): one hinted group, id 2,
    # after the round's ids 0 and 1, from a seed of its own.
    seed = run.config.train.seed * 1_000_003 + 1
    assert rollout.calls == [([0, 1], seed, 0), ([0], seed + HINT_SEED_OFFSET, 2)]
    hinted = [t for t in batch.sampled if t.hinted]
    assert {t.group_id for t in hinted} == {2} and len(hinted) == 4 and [t.reward for t in hinted] == [1, 0, 0, 0]
    assert all("Hint: a correct reply begins with: -" in tok.decode(t.input_ids[:t.prompt_len]) for t in hinted)
    assert not any("Hint:" in tok.decode(t.input_ids) for t in batch.sampled if not t.hinted)
    assert batch.shaping["guidance/hinted"] == 1.0 and batch.shaping["guidance/hinted_solved"] == 1.0
    assert batch.shaping["guidance/all_fail_groups"] == 2.0 and batch.shaping["guidance/guided"] == 0.0
    # DAPO keeps the one group that varies: the hinted one, trained as sampled (not as a reference), the
    # success pushed up, the failures down. The original groups stay sampled, all-fail.
    assert batch.kept == hinted and not any(t.guided for t in batch.kept)
    assert batch.kept[0].advantage > 0 and all(t.advantage < 0 for t in batch.kept[1:])
    assert {t.group_id for t in batch.sampled if not t.hinted} == {0, 1}
    # The policy's reward leaves the hinted success out: everything it sampled from the bare prompts failed.
    assert step_metrics(batch, {}, 1.0, 1.0)["reward/mean"] == 0.0


def test_a_hinted_group_still_all_fail_gets_the_reference_on_its_own_prompt(tmp_path, tok):
    run = _run(tmp_path, "guidance.hint_fraction=0.5", "guidance.reference=true")
    batch = produce_batch(run, 1, rollout_fn=ScriptedRollout(tok, solve_hinted=False))
    m = batch.shaping
    assert m["guidance/hinted"] == 1.0 and m["guidance/hinted_solved"] == 0.0
    assert m["guidance/all_fail_groups"] == 3.0 and m["guidance/guided"] == 3.0  # groups 0, 1 and the hinted 2
    group = [t for t in batch.kept if t.group_id == 2]
    reference = group[-1]
    assert reference.guided and not reference.hinted and reference.reward == 1.0
    n = group[0].prompt_len
    assert reference.input_ids[:n] == group[0].input_ids[:n] and "Hint:" in tok.decode(reference.input_ids[:n])
    assert all(t.hinted for t in group[:-1])


@pytest.mark.parametrize("overrides", [
    ("guidance.reference=true",),  # hints off
    ("guidance.hint_fraction=0.5", "guidance.hint_anneal_steps=2"),  # annealed to 0 by step 3
])
def test_nothing_is_hinted_when_the_fraction_is_zero(tmp_path, tok, overrides):
    run = _run(tmp_path, *overrides)
    rollout = ScriptedRollout(tok)
    batch = produce_batch(run, 3, rollout_fn=rollout)
    assert len(rollout.calls) == 1 and not any(t.hinted for t in batch.sampled)
    assert batch.shaping.get("guidance/hinted", 0.0) == 0.0
    assert ("guidance/hinted" in batch.shaping) == ("guidance.hint_fraction=0.5" in overrides)


def test_guidance_is_built_for_hints_alone(tmp_path):
    assert _run(tmp_path, "guidance.hint_fraction=0.5").guidance is not None
    assert _run(tmp_path).guidance is None


@pytest.mark.slow
def test_a_resumed_run_hints_what_the_whole_run_did(tmp_path):
    import json

    from polyrl.run.loop import train

    def config(steps):
        return load_config(SMOKE, [f"train.steps={steps}", "guidance.hint_fraction=0.5",
                                   "guidance.hint_anneal_steps=4", "eval.before=false", "eval.after=false",
                                   "logging.tensorboard=false", "logging.report=false", "rollout.max_new_tokens=6"])

    train(config(2), tmp_path / "a", log=lambda *_: None)
    train(config(1), tmp_path / "b", log=lambda *_: None)
    train(config(2), tmp_path / "b", resume=True, log=lambda *_: None)
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    keys = ("guidance/hinted", "guidance/hinted_solved", "reward/mean", "loss")
    assert sum(r["guidance/hinted"] for r in rows[0]) > 0
    assert [[r[k] for k in keys] for r in rows[0]] == [[r[k] for k in keys] for r in rows[1]]
