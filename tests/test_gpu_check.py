"""benchmarks/gpu_check.py on the CPU: its plan, ``--cpu-smoke`` end to end (every part in one worker process,
about 20 s on 2 cores, 10 s more with trl installed), a failing part and a part past its timeout."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_the_gpu_plan_is_qwen3_shaped_and_fits_eight_minutes():
    parts = {p.name: p for p in gpu_check.plan(smoke=False, trl_skip="trl not installed")}
    assert list(parts) == list(gpu_check.PARTS)
    assert parts["update_0.6b"].kwargs["size"] == "0.6b" and parts["update_1.7b"].kwargs["size"] == "1.7b"
    assert parts["trl"].skip == "trl not installed"
    # TRL and polyrl's rollout see the same rows (prompts x group) and lengths.
    for key in ("size", "prompts", "group_size", "prompt_len", "new_tokens", "micro_batch"):
        assert parts["trl"].kwargs[key] == parts["rollout_sync"].kwargs[key], key
    assert all(p.skip is None for name, p in parts.items() if name != "trl")
    assert gpu_check.TOTAL_BUDGET_S <= 8 * 60


def test_trl_missing_names_what_is_absent(monkeypatch):
    present = {"trl", "datasets"}
    monkeypatch.setattr(gpu_check, "find_spec", lambda name: object() if name in present else None)
    assert gpu_check.trl_missing() == "trl needs pyarrow, pandas, not installed"
    present.clear()
    assert gpu_check.trl_missing() == "trl not installed"


def test_one_line_error_names_the_exception():
    log = "loading\nTraceback (most recent call last):\n  File 'x.py'\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    assert gpu_check.one_line_error(log, 1) == "torch.OutOfMemoryError: CUDA out of memory."
    assert gpu_check.one_line_error("Segmentation fault\n", -11) == "exit code -11: Segmentation fault"
    assert gpu_check.one_line_error("", 1) == "exit code 1: no output"


@pytest.mark.slow
def test_a_failing_part_records_one_line_and_the_next_part_runs(tmp_path):
    broken = gpu_check.Part("broken", "gpu_check_parts.update", {**gpu_check.SHAPES["update_0.6b"][1], "size": "9b"})
    fine = gpu_check.Part("fine", "gpu_check_parts.update", dict(gpu_check.SHAPES["update_0.6b"][1]))
    records = gpu_check.run_parts([broken, fine], tmp_path, smoke=True, budget_s=300)
    assert records["broken"]["status"] == "failed"
    assert records["broken"]["error"] == "ValueError: unknown size '9b' for qwen3 (known: tiny, 1b, 0.6b, 1.7b)"
    assert records["fine"]["status"] == "ok" and records["fine"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_part_past_its_timeout_is_killed(tmp_path):
    slow = gpu_check.Part("slow", "gpu_check_parts.parity", dict(gpu_check.SHAPES["parity"][1]), timeout_s=1)
    record = gpu_check.run_parts([slow], tmp_path, smoke=True, budget_s=300)["slow"]
    assert record["status"] == "failed" and record["error"] == "timed out after 1 s" and record["wall_s"] < 15


@pytest.mark.slow
def test_cpu_smoke_runs_every_part(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    rc = gpu_check.main(["--cpu-smoke", "--workdir", str(tmp_path), "--out", str(out)])
    results = json.loads(out.read_text())
    assert rc == 0, results
    machine = results["machine"]
    assert machine["mode"] == "cpu-smoke" and machine["torch"] and machine["date"] and machine["gpu"] is None
    parts = results["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    for name, record in parts.items():
        if name == "trl" and gpu_check.trl_missing():
            assert record == {"status": "skipped", "reason": gpu_check.trl_missing()}
        else:
            assert record["status"] == "ok" and record["summary"] and record["peak_host_rss_gib"] > 0, name
    assert parts["parity"]["compared"] == "cpu vs cpu" and parts["parity"]["gradients_rel_diff"] == 0.0
    assert parts["update_1.7b"]["tokens_per_s"] > 0 and parts["update_1.7b"]["mfu"] is None  # no peak for a CPU
    assert parts["rollout_sync"]["rollout_tokens_per_s"] > 0 and parts["rollout_sync"]["head_copy_equal"]
    assert parts["fsdp_checkpoint"]["checks"] and all(parts["fsdp_checkpoint"]["checks"].values())
    if parts["trl"]["status"] == "ok":
        assert parts["trl"]["trl_over_polyrl"] > 0
    printed = capsys.readouterr().out
    assert all(f"\n{name} " in printed for name in gpu_check.PARTS)
