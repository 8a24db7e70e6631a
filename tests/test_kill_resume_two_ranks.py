"""SIGKILL of a learner rank at learner.world_size=2 (FSDP2 over gloo, sharded checkpoints), then --resume: the
run ends bit-identical to an uninterrupted one, as tests/test_kill_resume.py requires of a single process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SMOKE
from test_kill_resume import ARGS, ENV, comparable

from polyrl.checkpoint.faults import KILL_AT
from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

WS2_KILL_POINTS = ["update:2+0.01", "ckpt_manifest:3"]  # inside an update, and inside a sharded save


def test_sigkill_of_two_ranks_resumes_bit_exactly(tmp_path):
    """learner.world_size=2 (FSDP2 over gloo, sharded checkpoints): a rank killed at any of these points ends
    the run with one line, and ``--resume`` continues it to the uninterrupted run's metrics, samples and
    weights, bit for bit."""
    from polyrl.checkpoint.sharded import read_model_tensors

    steps = 3  # enough for both kill points
    argv = ["train", str(SMOKE), *ARGS, f"train.steps={steps}", "learner.world_size=2", "learner.timeout_s=60"]
    server = ForkServer(ENV)  # the launcher is forked; it spawns its ranks as a plain run does

    def polyrl(out: Path, *extra: str, kill: str | None = None) -> subprocess.CompletedProcess:
        return server.run([*argv[:2], "--output", str(out), *argv[2:], *extra], {KILL_AT: kill} if kill else {})

    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    try:
        assert polyrl(ref_dir).returncode == 0
        for n, spec in enumerate(WS2_KILL_POINTS):
            done = polyrl(run_dir, *(["--resume"] if n else []), kill=spec)
            assert done.returncode == 2, f"{spec}: exit {done.returncode}\n{done.stderr[-2000:]}"
            last = done.stderr.strip().splitlines()[-1]
            assert last.startswith("error: learner rank") and "SIGKILL" in last, last
        final = polyrl(run_dir, "--resume")
        assert final.returncode == 0, final.stderr[-3000:]
    finally:
        server.close()

    ref_rows, rows = comparable(ref_dir / "metrics.jsonl"), comparable(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["grad_norm"] > 0 for r in ref_rows)
    for ref_row, row in zip(ref_rows, rows, strict=True):
        assert row == ref_row, f"step {row['step']} differs after resume"
    assert (run_dir / "trajectories.jsonl").read_text() == (ref_dir / "trajectories.jsonl").read_text()
    last = f"checkpoints/step-{steps}"
    ref_weights, weights = read_model_tensors(ref_dir / last), read_model_tensors(run_dir / last)
    assert ref_weights.keys() == weights.keys()
    assert all(torch.equal(ref_weights[k], weights[k]) for k in weights)
