"""End-to-end through the CLI on configs/smoke.yaml (tiny random model, 2 steps)."""

import json
import subprocess

import pytest
from conftest import SMOKE

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

REQUIRED = [
    "step",
    "reward/mean",
    "reward/chain_sum",
    "kl",
    "entropy",
    "loss",
    "response_length/mean",
    "tokens_per_s",
    "step_time_s",
]


def polyrl(cli, *args, check=True):
    """``polyrl *args`` forked from the tests' server (conftest ``polyrl_cli``); ``check``: exit 0 required."""
    res = cli.run(list(args))
    if check and res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr)
    return res


def test_train_smoke_writes_the_run_contract(polyrl_cli, tmp_path):
    out = tmp_path / "run"
    polyrl(polyrl_cli, "train", str(SMOKE), "--output", str(out))
    assert (out / "config.yaml").exists()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for key in REQUIRED:
        assert key in lines[0], key
    assert lines[0]["kl"] is not None and lines[0]["kl"] >= 0
    ckpt = out / "checkpoints" / "step-2"
    for name in (
        "model.safetensors",
        "config.json",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
        "manifest.json",
    ):
        assert (ckpt / name).exists(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["sampler"]["cursors"]["chain_sum"] == 4
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval_before"]) == {"chain_sum"} and set(summary["eval_after"]) == {"chain_sum"}
    assert 0.0 <= summary["eval_after"]["chain_sum"] <= 1.0
    stored = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(stored) == 2 * 2  # 2 steps x 2 groups x 1 sample per group
    assert (out / "tensorboard").is_dir()


def test_eval_prints_accuracy_json(polyrl_cli, tmp_path):
    res = polyrl(polyrl_cli, "eval", "--model", "tiny-random", "--task", "chain_sum", "--n", "4",
                 "--max-new-tokens", "4")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["n"] == 4 and 0.0 <= data["accuracy"] <= 1.0


def test_eval_unknown_task_lists_valid_ones(polyrl_cli):
    res = polyrl(polyrl_cli, "eval", "--model", "tiny-random", "--task", "chain_sums", "--n", "2", check=False)
    assert res.returncode == 2
    assert "unknown task 'chain_sums'" in res.stderr and "chain_sum" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_model_path_says_so(polyrl_cli, tmp_path):
    res = polyrl(
        polyrl_cli,
        "train", str(SMOKE), "--output", str(tmp_path / "r"), f"model.name={tmp_path}/nope", check=False
    )
    assert res.returncode == 2
    assert "no such directory" in res.stderr and "Traceback" not in res.stderr
