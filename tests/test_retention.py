"""Retention in a cascade: replay of earlier domains with a KL to their best checkpoints in RL stages, and
distill stages stopped early on validation items (polyrl/run/retention.py), on the tiny random model."""

from __future__ import annotations

import json

import pytest
import yaml

from polyrl.config_check import load_config
from polyrl.run import pipeline, retention
from tests.test_pipeline import write_config


def test_replay_weights_give_the_replayed_tasks_their_share():
    # own weights 1 and 3 (total 4); share 0.5 -> replayed mass 4, two tasks -> 2 each: 4 / (4 + 4) = 0.5.
    assert retention.replay_weights({"a": 1.0, "b": 3.0}, ["c", "d"], 0.5) == {"a": 1.0, "b": 3.0, "c": 2.0, "d": 2.0}
    # share 0.25 of one own task of weight 1: replayed 1/3, i.e. (1/3) / (1 + 1/3) = 0.25.
    assert retention.replay_weights({"a": 1.0}, ["c"], 0.25)["c"] == pytest.approx(1 / 3)
    assert retention.replay_weights({"a": 1.0}, [], 0.5) == {"a": 1.0}


def test_choose_part_stops_at_the_first_within_tolerance_else_the_best_worst_gap():
    target = {"a": 0.60, "b": 0.40}
    parts = [{"validation": {"a": 0.50, "b": 0.40}},   # worst gap -0.10
             {"validation": {"a": 0.59, "b": 0.36}},   # -0.04
             {"validation": {"a": 0.59, "b": 0.39}},   # -0.01: the first within 0.02
             {"validation": {"a": 0.70, "b": 0.50}}]
    assert retention.worst_gap(parts[1]["validation"], target) == pytest.approx(-0.04)
    assert retention.choose_part(parts, target, 0.02) == 2
    assert retention.choose_part(parts[:2], target, 0.02) == 1  # none within: the smallest shortfall
    assert retention.choose_part(parts[:1], target, 0.2) == 0   # the start is kept when it is already close


def test_validation_items_differ_from_the_reported_ones(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", [{"name": "rl", "steps": 1}],
                                   pipeline={"validation_size": 3}))
    val = retention.validation_config(cfg)
    assert [t.eval_size for t in val.tasks] == [3, 3]
    from polyrl.envs.base import make_task

    reported = make_task(cfg.tasks[1], cfg.train.seed).eval_items()
    checked = make_task(val.tasks[1], val.train.seed).eval_items()
    assert len(checked) == 3 and not {i["question"] for i in reported} & {i["question"] for i in checked}


@pytest.mark.parametrize("bad, msg", [
    ({"name": "d", "kind": "distill", "steps": 1, "replay": 0.5}, "apply to rl stages"),
    ({"name": "r", "steps": 1, "retain_coef": 1.0}, "needs replay"),
    ({"name": "r", "steps": 1, "until_within": 0.02}, "applies to distill stages"),
    ({"name": "r", "steps": 1, "replay_from": "all"}, "replay_from needs replay"),
    ({"name": "r", "steps": 1, "replay": 0.5, "replay_from": "later"}, "replay_from"),
    ({"name": "d", "kind": "distill", "steps": 1, "focus": 0.1}, "focus needs until_within"),
    ({"name": "d", "kind": "distill", "steps": 1, "until_within": 0.0, "focus": -1}, "focus"),
    ({"name": "d", "kind": "distill", "steps": 1, "rollout": {"group_sise": 2}}, "group_sise"),
    ({"name": "r", "steps": 1, "sft_from": "teacher"}, "sft_from applies to sft stages"),
    ({"name": "s", "kind": "sft", "steps": 1, "until_within": 0.0}, "until_within applies"),
    ({"name": "d", "kind": "distill", "steps": 1, "keep_best": True}, "keep_best applies to rl stages"),
])
def test_retention_keys_on_the_wrong_stage_are_config_errors(tmp_path, bad, msg):
    with pytest.raises(Exception, match=msg):
        load_config(write_config(tmp_path / "c.yaml", [bad]))


@pytest.mark.slow
def test_replay_stage_samples_earlier_tasks_with_a_kl_to_their_best(tmp_path, monkeypatch):
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              # The entropy term moves the policy off its teacher in the first step even when every group's
              # rewards are equal, so the second step's KL is above rounding.
              {"name": "rl_b", "tasks": ["basic_arithmetic"], "steps": 2, "replay": 0.5, "retain_coef": 0.5,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    script = iter([{"chain_sum": 0.2, "basic_arithmetic": 0.5},   # base
                   {"chain_sum": 0.6, "basic_arithmetic": 0.3},   # 1-rl_a: chain_sum's best
                   {"chain_sum": 0.6, "basic_arithmetic": 0.6}])  # 2-rl_b
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    stage_a, stage_b = state["rows"][1], state["rows"][2]
    assert "mixture" not in stage_a and "retain_teachers" not in stage_a  # nothing earlier to replay
    assert stage_b["mixture"] == {"chain_sum": 1.0, "basic_arithmetic": 1.0}
    assert stage_b["retain_teachers"] == {"chain_sum": stage_a["checkpoint"]}
    b_cfg = yaml.safe_load((tmp_path / "run/stages/2-rl_b/config.yaml").read_text())
    assert {t["name"]: t["teacher"] for t in b_cfg["tasks"]} == {"chain_sum": stage_a["checkpoint"],
                                                                 "basic_arithmetic": None}
    assert b_cfg["algorithm"]["regularisers"]["distill_coef"] == 0.5 and b_cfg["algorithm"]["loss"]["pg_coef"] == 1.0
    metrics = [json.loads(x) for x in (tmp_path / "run/stages/2-rl_b/metrics.jsonl").read_text().splitlines()]
    # Both tasks were sampled, and the rows of chain_sum carried a KL to its teacher.
    assert any("reward/chain_sum" in m for m in metrics) and any("reward/basic_arithmetic" in m for m in metrics)
    assert metrics[-1]["distill/reverse_kl"] > 1e-6


@pytest.mark.slow
def test_replay_from_all_holds_a_task_not_trained_yet_by_a_kl_to_its_best_so_far(tmp_path, monkeypatch):
    # The first stage has no earlier domain; with replay_from: all it replays the second stage's task, whose
    # best so far is the base model, so that task is held where it started instead of drifting.
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1, "replay": 0.5, "replay_from": "all",
               "retain_coef": 0.5},
              {"name": "rl_b", "tasks": ["basic_arithmetic"], "steps": 1}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    script = iter([{"chain_sum": 0.2, "basic_arithmetic": 0.5},   # base: basic_arithmetic's best so far
                   {"chain_sum": 0.6, "basic_arithmetic": 0.5},
                   {"chain_sum": 0.6, "basic_arithmetic": 0.6}])
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    stage_a, stage_b = state["rows"][1], state["rows"][2]
    assert stage_a["mixture"] == {"chain_sum": 1.0, "basic_arithmetic": 1.0}
    assert stage_a["retain_teachers"] == {"basic_arithmetic": cfg.model.name}
    assert "mixture" not in stage_b  # replay_from defaults to earlier stages, and rl_b sets no replay
    metrics = [json.loads(x) for x in (tmp_path / "run/stages/1-rl_a/metrics.jsonl").read_text().splitlines()]
    assert any("reward/basic_arithmetic" in m for m in metrics)


def _scripted(held_out: list[dict], validation: dict[str, dict]):
    """evaluate_domains with scripted results: the reported held-out items in order, validation by model."""
    reported = iter(held_out)

    def evaluate(config, model):
        if config.train.seed >= retention.VALIDATION_SEED_OFFSET:
            return validation[model.rstrip("/").split("/stages/")[-1]]
        return next(reported)
    return evaluate


def _second_stage(tmp_path, monkeypatch, stages: list[dict], held_out: list[dict], validation: dict) -> dict:
    """The second stage's row of a pipeline of ``stages`` run with scripted evaluations (``_scripted``)."""
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    monkeypatch.setattr(pipeline, "evaluate_domains", _scripted(held_out, validation))
    return pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)["rows"][2]


@pytest.mark.slow
def test_distill_stops_once_every_task_is_within_tolerance(tmp_path, monkeypatch):
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "distill", "kind": "distill", "steps": 6, "until_within": 0.02, "eval_every": 2}]
    # basic_arithmetic's teacher is the base (validation 0.5); the distill start is at 0.3, after 2 steps at 0.49.
    validation = {"tiny-random": {"chain_sum": 0.1, "basic_arithmetic": 0.5},
                  "1-rl_a/checkpoints/step-1": {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                  "2-distill/checkpoints/step-2": {"chain_sum": 0.6, "basic_arithmetic": 0.49}}
    held_out = [{"chain_sum": 0.2, "basic_arithmetic": 0.5}, {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                {"chain_sum": 0.6, "basic_arithmetic": 0.5}]
    row = _second_stage(tmp_path, monkeypatch, stages, held_out, validation)
    assert row["steps"] == 2 and row["samples"] == 2 * 2 * 2  # one part of 2 steps, not the budget of 6
    assert row["checkpoint"].endswith("2-distill/checkpoints/step-2")
    assert row["early_stop"]["kept_part"] == 1
    assert row["early_stop"]["teacher_validation"] == {"chain_sum": 0.6, "basic_arithmetic": 0.5}
    assert [p["steps"] for p in row["early_stop"]["parts"]] == [0, 2]
    assert sorted(p.name for p in (tmp_path / "run/stages/2-distill/checkpoints").iterdir()) == ["step-2"]


@pytest.mark.slow
def test_distill_at_the_end_of_its_budget_keeps_the_best_part(tmp_path, monkeypatch):
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "distill", "kind": "distill", "steps": 3, "until_within": 0.02, "eval_every": 2}]
    validation = {"tiny-random": {"chain_sum": 0.1, "basic_arithmetic": 0.5},
                  "1-rl_a/checkpoints/step-1": {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                  "2-distill/checkpoints/step-2": {"chain_sum": 0.55, "basic_arithmetic": 0.44},
                  "2-distill/checkpoints/step-3": {"chain_sum": 0.4, "basic_arithmetic": 0.5}}
    held_out = [{"chain_sum": 0.2, "basic_arithmetic": 0.5}, {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                {"chain_sum": 0.55, "basic_arithmetic": 0.45}]
    row = _second_stage(tmp_path, monkeypatch, stages, held_out, validation)
    # Parts of 2 and 1 steps (budget 3) of one run; neither within 0.02, part 1 falls least short (-0.06
    # against -0.2), and its checkpoint is still there to keep.
    assert [p["steps"] for p in row["early_stop"]["parts"]] == [0, 2, 3] and row["steps"] == 3
    assert row["early_stop"]["kept_part"] == 1
    assert row["checkpoint"].endswith("2-distill/checkpoints/step-2")


def test_best_mean_part_takes_the_highest_mean_and_the_earliest_on_a_tie():
    parts = [{"validation": {"a": 0.5, "b": 0.25}},     # mean 0.375
             {"validation": {"a": 0.75, "b": 0.125}},   # 0.4375: its own domain up by more than the other fell
             {"validation": {"a": 0.875, "b": 0.0}},    # 0.4375 again: a tie goes to the earlier part
             {"validation": {"a": 0.625, "b": 0.125}}]  # 0.375
    assert retention.best_mean_part(parts) == 1
    assert retention.best_mean_part(parts[:1]) == 0


@pytest.mark.slow
def test_rl_stage_with_keep_best_ends_at_its_best_validated_part(tmp_path, monkeypatch):
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "rl_b", "tasks": ["basic_arithmetic"], "steps": 5, "keep_best": True, "eval_every": 2}]
    # rl_b raises basic_arithmetic, and by its last steps costs chain_sum more than it gains.
    validation = {"tiny-random": {"chain_sum": 0.1, "basic_arithmetic": 0.1},
                  "1-rl_a/checkpoints/step-1": {"chain_sum": 0.6, "basic_arithmetic": 0.1},
                  "2-rl_b/checkpoints/step-2": {"chain_sum": 0.55, "basic_arithmetic": 0.3},
                  "2-rl_b/checkpoints/step-4": {"chain_sum": 0.3, "basic_arithmetic": 0.4},
                  "2-rl_b/checkpoints/step-5": {"chain_sum": 0.2, "basic_arithmetic": 0.45}}
    held_out = [{"chain_sum": 0.2, "basic_arithmetic": 0.1}, {"chain_sum": 0.6, "basic_arithmetic": 0.1},
                {"chain_sum": 0.55, "basic_arithmetic": 0.3}]
    row = _second_stage(tmp_path, monkeypatch, stages, held_out, validation)
    assert [p["steps"] for p in row["kept_best"]["parts"]] == [0, 2, 4, 5]  # every step is run
    assert row["steps"] == 5 and row["samples"] == 5 * 2 * 2
    assert row["kept_best"]["kept_part"] == 1 and row["checkpoint"].endswith("2-rl_b/checkpoints/step-2")
    assert sorted(p.name for p in (tmp_path / "run/stages/2-rl_b/checkpoints").iterdir()) == [
        "step-2", "step-4", "step-5"]


def test_focus_weights_scale_each_task_by_its_shortfall_in_points():
    target = {"a": 0.60, "b": 0.50, "c": 0.40}
    accuracy = {"a": 0.50, "b": 0.50, "c": 0.45}
    # a: 10 points short -> 2 * (1 + 0.1 * 10) = 4; b: level -> 1; c: above its target -> unchanged 3.
    weights = retention.focus_weights({"a": 2.0, "b": 1.0, "c": 3.0}, accuracy, target, 0.1)
    assert weights == pytest.approx({"a": 4.0, "b": 1.0, "c": 3.0})


@pytest.mark.slow
def test_distill_with_focus_samples_the_task_furthest_behind_more_and_takes_its_rollout(tmp_path, monkeypatch):
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "distill", "kind": "distill", "steps": 4, "until_within": 0.0, "eval_every": 2,
               "focus": 0.1, "rollout": {"prompts_per_step": 3, "group_size": 2}}]
    validation = {"tiny-random": {"chain_sum": 0.1, "basic_arithmetic": 0.5},
                  "1-rl_a/checkpoints/step-1": {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                  "2-distill/checkpoints/step-2": {"chain_sum": 0.55, "basic_arithmetic": 0.45},
                  "2-distill/checkpoints/step-4": {"chain_sum": 0.6, "basic_arithmetic": 0.5}}
    held_out = [{"chain_sum": 0.2, "basic_arithmetic": 0.5}, {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                {"chain_sum": 0.6, "basic_arithmetic": 0.5}]
    row = _second_stage(tmp_path, monkeypatch, stages, held_out, validation)
    parts = row["early_stop"]["parts"]
    # Start: basic_arithmetic 20 points below its teacher (the base model) -> weight 1 + 0.1 * 20 = 3.
    assert parts[0]["next_weights"] == pytest.approx({"chain_sum": 1.0, "basic_arithmetic": 3.0})
    # After 2 steps both are 5 points short -> 1.5 each; after 4 both are level, and the stage stops.
    assert parts[1]["next_weights"] == pytest.approx({"chain_sum": 1.5, "basic_arithmetic": 1.5})
    assert [p["steps"] for p in parts] == [0, 2, 4] and "next_weights" not in parts[2]
    assert row["samples"] == 4 * 3 * 2  # the stage's own rollout, not the top level's 2 x 2
    part_cfg = yaml.safe_load((tmp_path / "run/stages/2-distill/config.yaml").read_text())
    assert part_cfg["rollout"]["prompts_per_step"] == 3
    assert {t["name"]: t["weight"] for t in part_cfg["tasks"]} == pytest.approx({"chain_sum": 1.5,
                                                                                  "basic_arithmetic": 1.5})


@pytest.mark.slow
def test_a_run_stopped_and_resumed_with_stop_at_step_equals_one_run(tmp_path):
    # A distill stage's pauses must not restart Adam or the schedule: stopping at step 1 and resuming to 3
    # trains exactly as 3 steps in one go, learning rate included.
    from polyrl.run.loop import train
    from tests.conftest import SMOKE

    def cfg(stop):
        return load_config(SMOKE, ["train.steps=3", f"train.stop_at_step={stop}", "optim.schedule=linear",
                                   "algorithm.regularisers.entropy_coef=0.01", "eval.before=false", "eval.after=false",
                                   "logging.tensorboard=false", "logging.report=false", "logging.progress=false"])

    train(cfg(3), tmp_path / "a", log=lambda *_: None)
    assert train(cfg(1), tmp_path / "b", log=lambda *_: None)["steps"] == 1
    assert train(cfg(3), tmp_path / "b", resume=True, log=lambda *_: None)["steps"] == 3
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    keys = ("loss", "lr", "grad_norm", "entropy")
    assert [[r.get(k) for k in keys] for r in rows[0]] == [[r.get(k) for k in keys] for r in rows[1]]
    assert rows[1][0]["lr"] > rows[1][1]["lr"] > rows[1][2]["lr"]  # one linear decay over the 3 steps
    assert all(r["grad_norm"] > 0 for r in rows[1])


def test_correct_distinct_keeps_each_correct_reply_of_an_item_once():
    from polyrl.train.teacher_examples import correct_distinct
    from polyrl.types import Trajectory

    def traj(item, ids, score):
        return Trajectory(task="t", item_id=item, group_id=item, input_ids=ids, loss_mask=[0, 1], logprobs=[0, 0],
                          versions=[-1, 0], info={"score": score})
    replies = [traj(0, [5, 1], 1.0), traj(0, [5, 1], 1.0), traj(0, [5, 2], 0.5), traj(0, [5, 3], 1.0),
               traj(1, [5, 1], 1.0), traj(1, [5, 4], 0.0)]
    kept = correct_distinct(replies)
    # item 0: [5, 1] once (its twin dropped), [5, 3]; the partly right [5, 2] is not correct. item 1: [5, 1].
    assert [(t.item_id, t.input_ids) for t in kept] == [(0, [5, 1]), (0, [5, 3]), (1, [5, 1])]


@pytest.mark.slow
def test_sft_from_teacher_trains_on_the_best_checkpoints_correct_replies(tmp_path, monkeypatch):
    from polyrl.train import teacher_examples
    from tests.test_pipeline import weights_digest

    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "recall", "kind": "sft", "sft_from": "teacher", "steps": 2}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    held_out = [{"chain_sum": 0.2, "basic_arithmetic": 0.5}, {"chain_sum": 0.6, "basic_arithmetic": 0.3},
                {"chain_sum": 0.6, "basic_arithmetic": 0.5}]
    monkeypatch.setattr(pipeline, "evaluate_domains", _scripted(held_out, {}))
    played = []
    real = teacher_examples.rollout

    def scored(engine, requests, config, seed, version):
        # The tiny random model never answers right: score the first reply of each item correct at step 1 and
        # none at step 2, so one step learns and the other has nothing to learn from.
        out = real(engine, requests, config, seed, version)
        played.append((engine.model.name_or_path, [r[0].name for r in requests]))
        for i, t in enumerate(out):
            t.info["score"] = 1.0 if seed == cfg.train.seed + 1 and i % config.group_size == 0 else 0.0
        return out
    monkeypatch.setattr(teacher_examples, "rollout", scored)
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    row = state["rows"][2]
    # chain_sum's best is stage 1 (0.6), basic_arithmetic's the base model (0.5).
    assert row["teachers"] == {"chain_sum": state["rows"][1]["checkpoint"], "basic_arithmetic": "tiny-random"}
    metrics = [json.loads(x) for x in (tmp_path / "run/stages/2-recall/metrics.jsonl").read_text().splitlines()]
    assert [m["teacher/sampled"] for m in metrics] == [4, 4]  # 2 drawn items x group of 2 per step
    assert metrics[0]["teacher/kept"] == 2 and metrics[0]["loss/sft"] > 0 and metrics[0]["grad_norm"] > 0
    assert metrics[1]["teacher/kept"] == 0 and metrics[1]["loss/sft"] == 0
    ckpts = tmp_path / "run/stages/2-recall/checkpoints"
    # Step 2 had no correct reply: no optimizer step, so its weights are step 1's.
    assert weights_digest(str(ckpts / "step-1")) == weights_digest(str(ckpts / "step-2"))
    assert weights_digest(str(ckpts / "step-1")) != weights_digest(state["rows"][1]["checkpoint"])
    assert played


def test_an_sft_run_with_teachers_for_some_tasks_only_is_an_error(tmp_path):
    from polyrl.train.teacher_examples import TeacherExamples

    data = load_config(write_config(tmp_path / "c.yaml", [])).model_dump(mode="json")
    data["tasks"][0]["teacher"] = "tiny-random"
    with pytest.raises(ValueError, match="tasks.basic_arithmetic.teacher"):
        TeacherExamples(load_config("c", data=data), tokenizer=None)
