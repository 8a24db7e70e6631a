"""Pipelines end to end on the tiny random model: sft -> rl -> distill through the CLI, SIGKILL in the middle of
stage 2 and --resume, the task x stage table and registry, and a regression that inserts a distill stage."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from polyrl.checkpoint.faults import KILL_AT
from polyrl.config_check import load_config
from polyrl.run import pipeline

TASKS = [
    {"name": "chain_sum", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
     "prompt_suffix": " Answer with just the number.", "eval_size": 2},
    {"name": "basic_arithmetic", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
     "eval_size": 2},
]
BASE = {
    "name": "pipe",
    "model": {"name": "tiny-random", "bf16": False},
    "tasks": TASKS,
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
    "algorithm": {"regularisers": {"track_kl": False}},
    "optim": {"lr": 1e-3},
    "train": {"checkpoint_every": 1},
    "logging": {"progress": False, "tensorboard": False, "report": False},
}
THREE_STAGES = [
    {"name": "sft", "kind": "sft", "steps": 2},
    {"name": "rl", "kind": "rl", "tasks": ["chain_sum"], "steps": 2, "lr": 5e-4, "algorithm": {"advantage": "rloo"}},
    # The tiny model scores 0 everywhere, so every task's best on a tie is the stage's start: chain_sum's teacher
    # is named (the base model) so that the stage has something to teach.
    {"name": "distill", "kind": "distill", "steps": 1, "teachers": {"chain_sum": "tiny-random"}},
]


def write_config(path: Path, stages: list[dict], **extra) -> Path:
    path.write_text(yaml.safe_dump({**BASE, "stages": stages, **extra}))
    return path


def polyrl(cli, *args, env=None):
    """``polyrl *args`` forked from the tests' server (conftest ``polyrl_cli``, one thread)."""
    return cli.run(list(args), env)


def weights_digest(checkpoint: str) -> str:
    return json.loads((Path(checkpoint) / "manifest.json").read_text())["files"]["model.safetensors"]


@pytest.fixture(scope="module")
def three_stage_run(tmp_path_factory, polyrl_cli):
    tmp = tmp_path_factory.mktemp("pipe")
    cfg = write_config(tmp / "pipe.yaml", THREE_STAGES)
    res = polyrl(polyrl_cli, "train", str(cfg), "--output", str(tmp / "run"))
    assert res.returncode == 0, res.stderr[-3000:]
    return cfg, tmp / "run", res


@pytest.mark.slow
def test_three_stages_through_the_cli(three_stage_run):
    _, run, res = three_stage_run
    labels = ["1-sft", "2-rl", "3-distill"]
    assert sorted(p.name for p in (run / "stages").iterdir()) == labels
    state = json.loads((run / "stages.json").read_text())
    assert [r["label"] for r in state["rows"]] == ["base", *labels]
    assert [r["kind"] for r in state["rows"]] == ["base", "sft", "rl", "distill"]
    # Each stage starts from the one before and trains what it declares.
    sft_cfg = yaml.safe_load((run / "stages/1-sft/config.yaml").read_text())
    rl_cfg = yaml.safe_load((run / "stages/2-rl/config.yaml").read_text())
    distill_cfg = yaml.safe_load((run / "stages/3-distill/config.yaml").read_text())
    assert sft_cfg["model"]["name"] == "tiny-random"
    assert rl_cfg["model"]["name"] == state["rows"][1]["checkpoint"].rstrip("/")
    assert [t["name"] for t in rl_cfg["tasks"]] == ["chain_sum"]
    assert rl_cfg["optim"]["lr"] == 5e-4 and rl_cfg["algorithm"]["advantage"]["estimator"] == "rloo"
    assert distill_cfg["algorithm"]["loss"]["pg_coef"] == 0.0
    assert distill_cfg["algorithm"]["regularisers"]["distill_coef"] == 1.0
    # The distill stage's teachers: the one it names, else the registry's best checkpoint at that point (on a
    # tie the latest: here the stage's start).
    best_then = pipeline.registry(state["rows"][:3], latest_on_tie=True)
    assert best_then["basic_arithmetic"]["checkpoint"] == state["rows"][2]["checkpoint"]
    assert {t["name"]: t["teacher"] for t in distill_cfg["tasks"]} == {
        "chain_sum": "tiny-random", "basic_arithmetic": best_then["basic_arithmetic"]["checkpoint"]}
    sft_losses = [json.loads(x)["loss/sft"] for x in (run / "stages/1-sft/metrics.jsonl").read_text().splitlines()]
    assert len(sft_losses) == 2 and all(x > 0 for x in sft_losses)
    distill = [json.loads(x) for x in (run / "stages/3-distill/metrics.jsonl").read_text().splitlines()]
    assert distill[0]["distill/reverse_kl"] > 0 and distill[0]["loss/pg"] == 0.0
    assert "| task | base | 1-sft | 2-rl | 3-distill |" in res.stdout


@pytest.mark.slow
def test_table_and_registry_hold_every_task_and_its_best(three_stage_run):
    _, run, _ = three_stage_run
    state = json.loads((run / "stages.json").read_text())
    reg = json.loads((run / "registry.json").read_text())
    table = (run / "stages.md").read_text().splitlines()
    assert set(reg) == {"chain_sum", "basic_arithmetic"} == set(state["tasks"])
    for task in state["tasks"]:
        scores = [r["eval"][task] for r in state["rows"]]
        first_best = state["rows"][scores.index(max(scores))]
        assert reg[task] == {"stage": first_best["label"], "checkpoint": first_best["checkpoint"],
                             "accuracy": max(scores)}
        line = next(x for x in table if x.startswith(f"| {task} |"))
        assert line.count("|") == len(state["rows"]) + 4
        assert state["final_gap"][task] == pytest.approx(scores[-1] - max(scores))


@pytest.mark.slow
def test_sigkill_in_stage_two_resumes_there(tmp_path, three_stage_run, polyrl_cli):
    cfg, reference, _ = three_stage_run
    run = tmp_path / "run"
    killed = polyrl(polyrl_cli, "train", str(cfg), "--output", str(run), env={KILL_AT: "rollout:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = json.loads((run / "stages.json").read_text())
    assert [r["label"] for r in state["rows"]] == ["base", "1-sft"]  # stage 2 was interrupted
    assert (run / "stages/2-rl/checkpoints/step-1").is_dir()
    sft_metrics = (run / "stages/1-sft/metrics.jsonl").read_text()
    again = polyrl(polyrl_cli, "train", str(cfg), "--output", str(run))
    assert again.returncode == 2 and "--resume" in again.stderr  # never silently overwritten
    resumed = polyrl(polyrl_cli, "train", str(cfg), "--output", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stage 1-sft" not in resumed.stderr and "resumed from" in resumed.stderr and "step-1" in resumed.stderr
    assert (run / "stages/1-sft/metrics.jsonl").read_text() == sft_metrics  # the finished stage is untouched
    final = json.loads((run / "stages.json").read_text())
    expected = json.loads((reference / "stages.json").read_text())
    assert [r["eval"] for r in final["rows"]] == [r["eval"] for r in expected["rows"]]
    # Exact resume: the pipeline ends with the same weights as the uninterrupted run.
    assert weights_digest(final["rows"][-1]["checkpoint"]) == weights_digest(expected["rows"][-1]["checkpoint"])


def test_find_regressions_uses_the_threshold():
    rows = [{"label": "base", "checkpoint": "m", "eval": {"a": 0.50, "b": 0.40}},
            {"label": "1-x", "checkpoint": "c1", "eval": {"a": 0.60, "b": 0.45}}]
    found = pipeline.find_regressions(rows, {"a": 0.57, "b": 0.44}, threshold=0.02)
    assert found == {"a": {"best": 0.60, "best_stage": "1-x", "now": 0.57}}  # a fell 3 points, b only 1
    assert pipeline.find_regressions(rows, {"a": 0.59, "b": 0.44}, threshold=0.02) == {}
    # 0.20 - 0.18 is 0.020000000000000018 in floating point: a drop of exactly the threshold is not more
    assert pipeline.find_regressions([{"label": "base", "checkpoint": "m", "eval": {"a": 0.20}}], {"a": 0.18},
                                      threshold=0.02) == {}


@pytest.mark.slow
def test_regression_inserts_a_distill_stage_from_the_best_checkpoint(tmp_path, monkeypatch):
    # The entropy bonus moves the weights (the tiny model earns no reward), so the student differs from its teacher.
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "rl_b", "tasks": ["basic_arithmetic"], "steps": 1}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages,
                                   pipeline={"on_regression": "distill", "regression_steps": 1}))
    # Scripted held-out accuracies (the tiny model scores 0 everywhere): rl_a gains on chain_sum and loses
    # basic_arithmetic, the inserted stage recovers it, and rl_b's drop on chain_sum is only reported again.
    script = iter([
        {"chain_sum": 0.2, "basic_arithmetic": 0.5},  # base
        {"chain_sum": 0.6, "basic_arithmetic": 0.3},  # 1-rl_a: basic_arithmetic -20 pts
        {"chain_sum": 0.55, "basic_arithmetic": 0.5},  # 2-recover: chain_sum -5 pts, no second insertion
        {"chain_sum": 0.6, "basic_arithmetic": 0.6},  # 3-rl_b
    ])
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    assert [r["label"] for r in state["rows"]] == ["base", "1-rl_a", "2-recover", "3-rl_b"]
    assert state["rows"][1]["regressions"] == {
        "basic_arithmetic": {"best": 0.5, "best_stage": "base", "now": 0.3}
    }
    assert set(state["rows"][2]["regressions"]) == {"chain_sum"}
    assert state["plan"][1]["inserted_after"] == "1-rl_a"
    recover = yaml.safe_load((tmp_path / "run/stages/2-recover/config.yaml").read_text())
    assert [t["name"] for t in recover["tasks"]] == ["basic_arithmetic"]
    assert recover["tasks"][0]["teacher"] == "tiny-random"  # the base model was its best
    assert recover["model"]["name"] == state["rows"][1]["checkpoint"]  # the student is the regressed policy
    assert recover["algorithm"]["regularisers"]["distill_coef"] == 1.0
    assert recover["algorithm"]["loss"]["pg_coef"] == 0.0
    distill = json.loads((tmp_path / "run/stages/2-recover/metrics.jsonl").read_text().splitlines()[0])
    assert distill["distill/reverse_kl"] > 0
    assert "↓" in (tmp_path / "run/stages.md").read_text()
    reg = json.loads((tmp_path / "run/registry.json").read_text())
    assert reg["chain_sum"]["stage"] == "1-rl_a" and reg["basic_arithmetic"]["stage"] == "3-rl_b"


@pytest.mark.slow
def test_distill_keeps_a_task_whose_teacher_is_the_stage_start(tmp_path, monkeypatch):
    # After rl_a, chain_sum's best checkpoint is rl_a's own, which the distill stage starts from; it is still
    # distilled (held against that checkpoint while basic_arithmetic, whose best is the base model, moves).
    stages = [{"name": "rl_a", "tasks": ["chain_sum"], "steps": 1,
               "algorithm": {"regularisers": {"entropy_coef": 0.01}}},
              {"name": "distill", "kind": "distill", "steps": 1}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    script = iter([{"chain_sum": 0.2, "basic_arithmetic": 0.5},  # base
                   {"chain_sum": 0.6, "basic_arithmetic": 0.3},  # 1-rl_a
                   {"chain_sum": 0.6, "basic_arithmetic": 0.4}])  # 2-distill
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    logs: list[str] = []
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=logs.append)
    row, start = state["rows"][2], state["rows"][1]["checkpoint"]
    assert row["teachers"] == {"chain_sum": start, "basic_arithmetic": "tiny-random"}
    assert "stage 2-distill: basic_arithmetic taught by tiny-random" in logs
    assert any(m.startswith("stage 2-distill: chain_sum retained as it is") for m in logs)
    distill_cfg = yaml.safe_load((tmp_path / "run/stages/2-distill/config.yaml").read_text())
    assert {t["name"]: t["teacher"] for t in distill_cfg["tasks"]} == row["teachers"]
    metrics = json.loads((tmp_path / "run/stages/2-distill/metrics.jsonl").read_text().splitlines()[0])
    assert metrics["distill/reverse_kl"] > 0
    assert row["samples"] == 1 * 2 * 2  # steps x prompts x group


@pytest.mark.slow
def test_distill_stage_with_every_teacher_its_start_is_skipped(tmp_path, monkeypatch):
    stages = [{"name": "rl", "steps": 1}, {"name": "distill", "kind": "distill", "steps": 1}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    script = iter([{"chain_sum": 0.2, "basic_arithmetic": 0.3},  # base
                   {"chain_sum": 0.6, "basic_arithmetic": 0.5}])  # 1-rl: the best for both tasks
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    rl, distill = state["rows"][1], state["rows"][2]
    assert distill["teachers"] == {}
    assert distill["checkpoint"] == rl["checkpoint"] and distill["eval"] == rl["eval"] and distill["steps"] == 0
    assert not (tmp_path / "run/stages/2-distill").exists()  # no training step was taken


@pytest.mark.slow
def test_a_task_whose_start_ties_its_best_is_retained_not_taught_by_the_earlier_checkpoint(tmp_path, monkeypatch):
    # basic_arithmetic scores 0.5 at the base model and after rl: on a tie the distill stage's teacher is its
    # start, so with chain_sum also at its best there it has nothing to teach and takes no step.
    stages = [{"name": "rl", "steps": 1}, {"name": "distill", "kind": "distill", "steps": 1}]
    cfg = load_config(write_config(tmp_path / "c.yaml", stages))
    script = iter([{"chain_sum": 0.2, "basic_arithmetic": 0.5},  # base
                   {"chain_sum": 0.6, "basic_arithmetic": 0.5}])  # 1-rl: chain_sum's best, basic_arithmetic ties
    monkeypatch.setattr(pipeline, "evaluate_domains", lambda config, model: next(script))
    state = pipeline.run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    rl, distill = state["rows"][1], state["rows"][2]
    assert distill["steps"] == 0 and distill["checkpoint"] == rl["checkpoint"]
    assert not (tmp_path / "run/stages/2-distill").exists()
    # The table and the registry still name the earliest stage at that score.
    assert json.loads((tmp_path / "run/registry.json").read_text())["basic_arithmetic"]["stage"] == "base"
    rows = state["rows"][:2]
    assert pipeline.registry(rows)["basic_arithmetic"]["checkpoint"] == "tiny-random"
    assert pipeline.registry(rows, latest_on_tie=True)["basic_arithmetic"]["checkpoint"] == rl["checkpoint"]
