"""Runs that survive SIGKILL: kill `polyrl train` at many points, resume with --resume, and require
metrics.jsonl (timing keys aside), trajectories.jsonl and the final weights to be bit-identical to an
uninterrupted run with the same seed.

The reference is a plain ``python -m polyrl train`` subprocess. The interrupted runs are forked, one per
attempt, from a server that has imported polyrl (and torch) but run nothing (tests/forkserver.py): each child
runs the same CLI entry point in a process of its own and dies by a real SIGKILL, without paying the imports
each time. Kills come from polyrl.checkpoint.faults (POLYRL_TEST_KILL_AT); a trace of the points reached shows
where each kill landed. Two learner ranks killed and resumed: tests/test_kill_resume_two_ranks.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOKE

from polyrl.checkpoint.faults import KILL_AT, TRACE
from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

STEPS = 5
ARGS = [
    f"train.steps={STEPS}", "train.checkpoint_every=1", "eval.before=false", "eval.after=false",
    "logging.tensorboard=false", "logging.report=false", "logging.progress=false",
    # The tiny random model never earns a reward, so GRPO advantages are all zero; the entropy bonus and KL
    # penalty make every update move the weights and the optimizer state, so resuming them is put to the test.
    "algorithm.regularisers.entropy_coef=0.01", "algorithm.regularisers.kl_coef=0.01", "rollout.group_size=2",
    # Long enough a generation (about 50 ms on the fused bf16 path, longer elsewhere) that a kill 0.02 s into it
    # lands inside it on a fast machine.
    "rollout.max_new_tokens=192",
]
# One thread per run: runs are small, the machine is shared, and reference and chain must match anyway.
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Each kill point, in the order the chain hits them; "+d" kills d seconds after the point (inside the work
# that follows it), "#N" at the N-th time the point is reached.
KILL_POINTS = [
    "rollout:1+0.02",  # generating step 1, before any checkpoint exists
    "update:1+0.01",  # inside the first optimizer update
    "logged:1",  # metrics of step 1 written, its checkpoint not yet
    "ckpt_files:1",  # checkpoint files in the temp dir, no manifest
    "ckpt_manifest:1",  # manifest written, temp dir not yet renamed
    "ckpt_renamed:1",  # step-1 in place
    "rollout:2+0.02",
    "update:2+0.01",
    "logged:3",
    "ckpt_files:3",
    "ckpt_manifest:4",
    "ckpt_renamed:4",  # before old checkpoints are pruned
    "update:5+0.01",
    "ckpt_manifest:5",  # inside the last step's save (also the final one), after training finished
]

def comparable(path: Path) -> list[dict]:
    """metrics.jsonl rows without measured durations and rates (keys ending in ``_s``)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in rows]


def final_weights_digest(run_dir: Path) -> str:
    manifest = json.loads((run_dir / "checkpoints" / f"step-{STEPS}" / "manifest.json").read_text())
    return manifest["files"]["model.safetensors"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    # Started first and left to run alongside the interrupted chain.
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl", "train", str(SMOKE), "--output", str(out), *ARGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV},
    )
    yield proc, out


def test_sigkill_at_every_point_resumes_bit_exactly(tmp_path, reference):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.txt"
    argv = ["train", str(SMOKE), "--output", str(run_dir), *ARGS]
    server = ForkServer(ENV)
    landed = {}
    try:
        for n, spec in enumerate(KILL_POINTS):
            trace.write_text("")
            done = server.run(argv + (["--resume"] if n else []), {KILL_AT: spec, TRACE: str(trace)})
            assert done.returncode == -signal.SIGKILL, f"{spec}: exit {done.returncode}\n{done.stderr[-2000:]}"
            reached = trace.read_text().split()
            landed[spec] = reached[-1] if reached else None
        done = server.run(argv + ["--resume"])
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        server.close()

    # Every kill landed where it was aimed: after its point and before the next one.
    target = {spec: spec.partition("+")[0].partition("#")[0] for spec in KILL_POINTS}
    missed = [spec for spec in KILL_POINTS if landed[spec] != target[spec]]
    assert not missed, f"kills that landed elsewhere: {[(s, landed[s]) for s in missed]}"

    proc, ref_dir = reference
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    ref_rows, rows = comparable(ref_dir / "metrics.jsonl"), comparable(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > 0 for r in ref_rows) and ref_rows[-1]["kl"] > 0  # the updates did something
    for ref_row, row in zip(ref_rows, rows, strict=True):
        assert row == ref_row, f"step {row['step']} differs after resume"
    assert (run_dir / "trajectories.jsonl").read_text() == (ref_dir / "trajectories.jsonl").read_text()
    assert final_weights_digest(run_dir) == final_weights_digest(ref_dir)
    # Nothing half-written is left: no temp checkpoint dirs, and every checkpoint kept verifies.
    from polyrl.checkpoint.store import list_checkpoints, verify_checkpoint

    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(run_dir))
    print(f"kill points resumed bit-exactly: {len(KILL_POINTS)}/{len(KILL_POINTS)}")


def test_a_line_torn_by_a_kill_is_dropped_on_resume(tmp_path):
    """A SIGKILL inside a large write() can leave half a JSON line; resuming must not choke on it."""
    from polyrl.observe.metrics import open_step_log

    path = tmp_path / "trajectories.jsonl"
    whole = [json.dumps({"step": s, "text": "é" * 10}) for s in (1, 2, 3)]
    torn = json.dumps({"step": 4, "text": "é" * 5000}).encode()[:7001]  # cut inside a 2-byte character
    path.write_bytes(("\n".join(whole) + "\n").encode() + torn)
    with open_step_log(path, keep_through_step=2) as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert path.read_text().splitlines() == [*whole[:2], json.dumps({"step": 3})]
