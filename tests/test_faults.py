"""Faults beyond the kill points of test_kill_resume.py: a full disk while a checkpoint is written (a clear
error, the checkpoint before intact and resumed from), kills during evaluation and during the report, a
damaged trajectories file on resume. Each resumed run must end as an uninterrupted one with the same seed:
metrics (timing keys aside), trajectories and weights bit-identical."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os

import pytest
import torch
from conftest import SMOKE

from polyrl.checkpoint import store as ckpt_module
from polyrl.checkpoint.faults import DISK_FULL_AT, KILL_AT
from polyrl.checkpoint.store import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.observe.metrics import open_step_log
from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

STEPS = 3
ARGS = [f"train.steps={STEPS}", "train.checkpoint_every=1", "tasks.0.eval_size=4", "logging.tensorboard=false",
        "algorithm.regularisers.entropy_coef=0.01", "rollout.group_size=2", "rollout.max_new_tokens=8"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------------ units

def test_a_full_disk_mid_checkpoint_is_a_clear_error_and_keeps_the_one_before(tmp_path, monkeypatch):
    model, tok = load_model("tiny-random", seed=0), load_tokenizer("tiny-random")
    save_checkpoint(tmp_path, 1, model, tok, {"optimizer": {"step": 1}}, {"sampler": {}})
    real_save = torch.save

    def save_until_full(obj, path, *args, **kwargs):  # the optimizer's file gets half written, then ENOSPC
        if str(path).endswith("optimizer.pt"):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.torch, "save", save_until_full)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 2, model, tok, {"optimizer": {"step": 2}}, {"sampler": {}})
    message = str(err.value)
    assert "step-2: checkpoint not written (No space left on device)" in message
    assert f"{tmp_path / 'checkpoints' / 'step-1'} is intact; --resume continues from it" in message
    assert "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]  # the temp dir is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"


def test_a_full_disk_on_the_first_checkpoint_says_there_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv(DISK_FULL_AT, "ckpt_weights:1")
    with pytest.raises(CheckpointError, match="no earlier checkpoint exists"):
        save_checkpoint(tmp_path, 1, load_model("tiny-random", seed=0), load_tokenizer("tiny-random"), {}, {})
    assert list_checkpoints(tmp_path) == [] and not any((tmp_path / "checkpoints").iterdir())


def test_a_damaged_step_log_keeps_every_readable_line_and_names_the_rest(tmp_path, caplog):
    path = tmp_path / "trajectories.jsonl"
    good = [json.dumps({"step": s, "text": t}).encode() for s, t in ((1, "a"), (1, "b"), (2, "c"), (3, "d"))]
    lines = [good[0], b'{"step": 1, "text": "torn', good[1], b'{"step": 1, "text": "\xff\xfe"}', b"[1, 2]",
             b'{"step": "2"}', b'{"text": "no step"}', good[2], good[3], b"\0" * 64]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="polyrl.observe.metrics"):
        open_step_log(path, keep_through_step=2).close()
    assert path.read_bytes() == b"".join(line + b"\n" for line in good[:3])  # step 3 is after the checkpoint
    (record,) = caplog.records
    assert f"{path}: 6 unreadable line(s) dropped on resume (line 2, 4, 5, 6, 7 ...); 3 kept" == record.getMessage()


def test_an_unreadable_step_log_is_one_line(tmp_path):
    from polyrl.observe.metrics import SinkError

    (tmp_path / "trajectories.jsonl").mkdir()
    with pytest.raises(SinkError, match="trajectories.jsonl: cannot be read to resume the run"):
        open_step_log(tmp_path / "trajectories.jsonl", keep_through_step=1)


# ---------------------------------------------------------------------------------------- whole runs

@pytest.fixture(scope="module")
def cli():
    """``polyrl`` runs forked from one server per module (tests/forkserver.py): real processes, real kills."""
    server = ForkServer(ENV)
    yield server
    server.close()


def _train(cli, out, *extra, env=None, resume=False):
    argv = ["train", str(SMOKE), "--output", str(out), *ARGS, *extra, *(["--resume"] if resume else [])]
    return cli.run(argv, env)


def _result(out):
    metrics = [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")}
               for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = hashlib.sha256((out / "checkpoints" / f"step-{STEPS}" / "model.safetensors").read_bytes()).hexdigest()
    summary = json.loads((out / "summary.json").read_text())
    evals = {k: summary.get(k) for k in ("eval_before", "eval_after")}
    return metrics, (out / "trajectories.jsonl").read_text(), weights, evals


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli):
    out = tmp_path_factory.mktemp("reference") / "run"
    res = _train(cli, out)
    assert res.returncode == 0, res.stderr[-2000:]
    return _result(out)


def test_full_disk_during_a_checkpoint_then_resume(tmp_path, cli, reference):
    out = tmp_path / "run"
    res = _train(cli, out, env={DISK_FULL_AT: "ckpt_weights:2"})
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "step-2: checkpoint not written (No space left on device)" in last
    assert f"{out / 'checkpoints' / 'step-1'} is intact" in last and "Traceback" not in res.stderr
    assert [p.name for p in list_checkpoints(out)] == ["step-1"]
    res = _train(cli, out, resume=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stderr and "step-1" in res.stderr
    assert _result(out) == reference


@pytest.mark.parametrize("kill_at", ["eval_before:0+0.05", "eval_after:3", "eval_after:3+0.05", "report:3",
                                     "report:3+0.02"])
def test_killed_during_evaluation_or_the_report_then_resumed(tmp_path, cli, reference, kill_at):
    out = tmp_path / "run"
    res = _train(cli, out, env={KILL_AT: kill_at})
    assert res.returncode == -9, f"{kill_at} did not kill the run: {res.stderr[-2000:]}"
    res = _train(cli, out, resume=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _result(out) == reference
    page = (out / "report.html").read_text()
    assert page.endswith("</html>") and "Training curves" in page
    assert not list(out.glob("*.tmp"))


def test_damaged_trajectories_file_on_resume(tmp_path, cli, reference):
    out = tmp_path / "run"
    assert _train(cli, out, env={KILL_AT: "logged:2"}).returncode == -9  # step 2 logged, its checkpoint not written
    path = out / "trajectories.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lost = lines[1]
    path.write_bytes(lines[0] + b'{"step": 1, "ta\xff\n' + b"".join(lines[2:]) + b'{"step": 2, "tex')  # torn tail
    res = _train(cli, out, resume=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"trajectories.jsonl: 2 unreadable line(s) dropped on resume (line 2, {len(lines) + 1})" in res.stderr
    metrics, trajectories, weights, evals = _result(out)
    ref_metrics, ref_trajectories, ref_weights, ref_evals = reference
    # Only the damaged line is gone; training, metrics and every other stored sample are as if nothing happened.
    assert (metrics, weights, evals) == (ref_metrics, ref_weights, ref_evals)
    assert trajectories == ref_trajectories.replace(lost.decode(), "", 1)
