"""benchmarks/gpu_check.py on the CPU: its parts' configs, reading their results, and ``--cpu-smoke`` end to end
(two parts in worker processes, about 50 s on 2 cores), a failing part and a part past its timeout."""

from __future__ import annotations

import importlib.util
import json
import sys

from conftest import ROOT

from polyrl.config_check import load_config

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _parts(**kwargs) -> dict[str, gpu_check.Part]:
    return {p.name: p for p in gpu_check.plan(**kwargs)}


def test_gpu_plan_one_gpu_without_vllm(tmp_path):
    parts = _parts(smoke=False, gpus=1, vllm=False, workdir=tmp_path)
    assert list(parts) == list(gpu_check.PARTS)
    hf = load_config(None, data=parts["quickstart_hf"].config)
    assert hf.train.device == "cuda" and hf.train.steps == 20 and hf.engine.kind == "hf"
    assert hf.tasks[0].eval_size == 100 and hf.model.name == "smollm2-135m-instruct"
    assert parts["quickstart_vllm"].skip == "vllm: not installed, skipped"
    assert parts["world_size_2"].skip == "learner.world_size=2: needs 2+ GPUs, this machine has 1"
    big = parts["model_1b"]
    cfg = load_config(None, data=big.config)
    assert big.make_model == {"arch": "llama3", "size": "1b", "path": str(tmp_path / "models" / "llama3-1b")}
    assert cfg.model.name == big.make_model["path"] and big.mode == "steps"
    assert not cfg.eval.before and not cfg.eval.after and cfg.algorithm.entropy_coef > 0
    assert sum(p.timeout_s for p in parts.values() if p.skip is None) <= gpu_check.TOTAL_BUDGET_S


def test_gpu_plan_two_gpus_with_vllm(tmp_path):
    parts = _parts(smoke=False, gpus=2, vllm=True, workdir=tmp_path)
    assert all(p.skip is None for p in parts.values())
    vllm = load_config(None, data=parts["quickstart_vllm"].config)
    assert vllm.engine.kind == "vllm" and vllm.train.device == "cuda"
    ranks = load_config(None, data=parts["world_size_2"].config)
    assert ranks.learner.world_size == 2 and ranks.train.device == "cuda"


def test_smoke_plan_runs_everything_on_the_cpu(tmp_path):
    parts = _parts(smoke=True, gpus=0, vllm=False, workdir=tmp_path)
    assert parts["world_size_2"].skip is None  # two gloo ranks
    for part in parts.values():
        cfg = load_config(None, data=part.config)
        assert cfg.train.device == "cpu" and cfg.train.steps == 2
    assert parts["model_1b"].make_model["size"] == "tiny"


def test_summarize_reads_medians_and_accuracy(tmp_path):
    rows = [
        {"step": 1, "step_time_s": 9.0, "rollout/tokens_per_s": 100.0, "sync/time_s": 0.5, "zero_gradient": 0.0,
         "skipped_updates": 0.0},
        {"step": 2, "step_time_s": 2.0, "rollout/tokens_per_s": 300.0, "sync/time_s": 0.1, "zero_gradient": 1.0,
         "skipped_updates": 0.0},
        {"step": 3, "step_time_s": 3.0, "rollout/tokens_per_s": 200.0, "sync/time_s": 0.2, "zero_gradient": 0.0,
         "skipped_updates": 0.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps(
        {"eval_before": {"chain_sum": 0.3}, "eval_after": {"chain_sum": 0.5}, "train_time_s": 14.0}))
    out = gpu_check.summarize(tmp_path)
    assert out["steps"] == 3 and out["step_time_s"] == 3.0 and out["first_step_time_s"] == 9.0
    assert out["rollout_tokens_per_s"] == 200.0 and out["sync_time_s"] == 0.2 and out["updates_run"] == 2
    assert out["accuracy_before"] == {"chain_sum": 0.3} and out["accuracy_after"] == {"chain_sum": 0.5}
    assert gpu_check.summarize(tmp_path / "missing") == {}


def test_one_line_error_names_the_exception():
    log = "loading\nTraceback (most recent call last):\n  File 'x.py'\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    assert gpu_check.one_line_error(log, 1) == "torch.OutOfMemoryError: CUDA out of memory."
    assert gpu_check.one_line_error("error: learner.world_size: 2 ranks\n", 2) == "error: learner.world_size: 2 ranks"
    assert gpu_check.one_line_error("Segmentation fault\n", -11) == "exit code -11: Segmentation fault"
    assert gpu_check.one_line_error("", 1) == "exit code 1: no output"


def test_a_failing_part_records_one_line(tmp_path):
    part = gpu_check.Part("broken", {"train": {"device": "cpu"}})  # no tasks
    record = gpu_check.run_part(part, tmp_path, timeout_s=120)
    assert record["status"] == "failed"
    assert record["error"] == "ConfigError: config: tasks: required key is missing"


def test_a_part_past_its_timeout_is_killed(tmp_path):
    part = gpu_check.Part("slow", gpu_check.quickstart_config(smoke=True, steps=2, eval_size=8))
    record = gpu_check.run_part(part, tmp_path, timeout_s=2)
    assert record == {**record, "status": "failed", "error": "timed out after 2 s"}
    assert record["wall_s"] < 30


def test_cpu_smoke_end_to_end(tmp_path, capsys):
    parts = ["quickstart_hf", "model_1b"] + ([] if HAS_VLLM else ["quickstart_vllm"])
    out = tmp_path / "gpu_check.json"
    rc = gpu_check.main(["--cpu-smoke", "--parts", *parts, "--workdir", str(tmp_path), "--out", str(out)])
    results = json.loads(out.read_text())
    assert rc == 0, results
    env = results["environment"]
    assert env["mode"] == "cpu-smoke" and env["torch"] and env["date"]
    hf = results["parts"]["quickstart_hf"]
    assert hf["status"] == "ok" and hf["steps"] == 2 and hf["updates_run"] == 2
    for key in ("step_time_s", "rollout_tokens_per_s", "sync_time_s", "peak_host_rss_gib"):
        assert hf[key] > 0, key
    assert set(hf["accuracy_before"]) == set(hf["accuracy_after"]) == {"chain_sum"}
    big = results["parts"]["model_1b"]
    assert big["status"] == "ok" and big["updates_run"] == 2 and "make_model_s" in big
    assert (tmp_path / "models" / "llama3-tiny" / "config.json").exists()
    if not HAS_VLLM:
        assert results["parts"]["quickstart_vllm"] == {"status": "skipped", "reason": "vllm: not installed, skipped",
                                                       "notes": []}
    assert "world_size_2" not in results["parts"]
    assert "quickstart_hf" in capsys.readouterr().out
