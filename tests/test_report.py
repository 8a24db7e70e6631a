"""The HTML run report: built only from the run's files, sections present when their data is, clear errors."""

import base64
import json
import re
import subprocess
import sys

import pytest
from conftest import SMOKE

from polyrl.observe.report import ReportError, load_run, stage_table, write_report, write_report_safely

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path, metrics, summary=None, trajectories=None, config="name: synthetic\n"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if trajectories is not None:
        (path / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajectories))
    if config is not None:
        (path / "config.yaml").write_text(config)
    return path


def _figures(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)


def _traj(step, task, reward, text, **flags):
    return {
        "step": step,
        "task": task,
        "item_id": step,
        "group_id": 0,
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "reward": reward,
        "advantage": reward - 0.5,
        "text": text,
        **flags,
    }


@pytest.mark.slow
def test_report_has_curves_eval_stages_samples_and_config(tmp_path):
    metrics = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/chain_sum": 0.2 * s,
            "reward/gsm": 0.05 * s,
            "kl": None if s == 1 else 0.01 * s,
            "clip_frac": 0.1,
            "staleness/mean": 1.0,
            "tokens_per_s": 100.0 + s,
            "step_time_s": 2.0,
            "grad_norm": 0.5,
            "ratio/chain_sum": 0.5,
            "note": "text",
        }
        for s in range(1, 26)
    ]
    summary = {
        "eval_before": {"chain_sum": 0.30, "gsm": 0.5},
        "eval_after": {"chain_sum": 0.40, "gsm": 0.45},
        "steps": 25,
        "train_time_s": 120.0,
        "wall_time_s": 200.0,
        "stages": [
            {"name": "sft", "eval": {"chain_sum": 0.3, "gsm": 0.5}},
            {"name": "rl-math", "eval": {"chain_sum": 0.45, "gsm": 0.4}},
        ],
    }
    trajs = [
        _traj(25, "chain_sum", 1.0, "the answer is <7>"),
        _traj(25, "chain_sum", 0.0, "no idea", truncated=True),
    ]
    run = _write_run(
        tmp_path / "run", metrics, summary, trajs, config="name: synthetic\noptim:\n  lr: 0.001\n"
    )

    page = write_report(run).read_text()

    figures = _figures(page)
    # Named panels for what was logged; no panel for entropy or response length, which were not.
    for title in (
        "Reward per task",
        "KL to reference",
        "Clip fraction",
        "Staleness",
        "Throughput",
        "Step time",
        "held-out evaluation",
    ):
        assert title in figures, title
    assert "Entropy" not in figures and "Response length" not in figures
    # Unclaimed numeric metrics are plotted by prefix; text metrics are skipped.
    assert "grad_norm" in figures and "ratio" in figures and "note" not in figures
    for b64 in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        assert base64.b64decode(b64)[:8] == PNG_MAGIC
    assert "+10.0 pts" in page and "-5.0 pts" in page  # chain_sum gained, gsm lost
    stages = page.split("id=stages-table>")[1].split("</table>")[0]
    assert "rl-math" in stages and '<td class="num best">45.0%</td>' in stages
    assert "the answer is &lt;7&gt;" in page  # replies are escaped, not injected
    assert "lr: 0.001" in page.split("id=config>")[1]
    assert "http" not in page.replace("http-equiv", "")  # self-contained: no external resources


def test_report_without_summary_or_trajectories(tmp_path):
    run = _write_run(tmp_path / "run", [{"step": 1, "reward/mean": 0.5}], config=None)
    page = write_report(run).read_text()
    assert _figures(page) == ["Reward per task"]
    assert "id=eval-table" not in page and "id=config" not in page and "Stored rollouts" not in page


@pytest.mark.slow
def test_missing_metrics_is_a_one_line_error(tmp_path):
    with pytest.raises(ReportError, match=r"metrics\.jsonl: not found"):
        load_run(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "polyrl", "report", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "metrics.jsonl: not found" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_bad_row_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl": 0.1}\n{"step": 2, "kl": \n')
    with pytest.raises(ReportError, match=r"metrics\.jsonl:2: not valid JSON"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"kl": 0.1}\n')
    with pytest.raises(ReportError, match=r"metrics\.jsonl:1: row has no integer 'step'"):
        load_run(tmp_path)


def test_stage_table_accepts_mapping_and_list():
    as_map = {"sft": {"math": 0.2}, "rl": {"math": 0.4, "code": 0.1}}
    as_list = [{"name": "sft", "eval": {"math": 0.2}}, {"stage": "rl", "scores": {"math": 0.4, "code": 0.1}}]
    assert stage_table(as_map) == stage_table(as_list) == as_map
    assert list(stage_table(as_list)) == ["sft", "rl"]  # stage order is kept
    assert stage_table("nonsense") == {}


def test_report_failure_is_a_warning_not_an_exception(tmp_path):
    messages = []
    assert write_report_safely(tmp_path / "missing", log=messages.append) is None
    assert len(messages) == 1 and messages[0].startswith("warning: report.html not written")


@pytest.mark.slow
def test_train_writes_report_at_the_end(tmp_path, polyrl_cli):
    out = tmp_path / "run"
    res = polyrl_cli.run(["train", str(SMOKE), "--output", str(out)])  # the command line, forked (conftest)
    assert res.returncode == 0, res.stderr[-2000:]
    page = (out / "report.html").read_text()
    assert "Reward per task" in _figures(page) and "Entropy" in _figures(page)
    assert "id=eval-table" in page and "chain_sum" in page and "name: smoke" in page
    mtime = (out / "report.html").stat().st_mtime_ns
    res = polyrl_cli.run(["report", str(out)])
    assert res.returncode == 0 and res.stdout.strip() == str(out / "report.html")
    assert (out / "report.html").stat().st_mtime_ns >= mtime


@pytest.mark.slow
def test_report_plots_the_engine_learner_mismatch_in_its_own_panel(tmp_path):
    metrics = [{"step": s, "reward/mean": 0.5, "mismatch/log_ratio": 0.01 * s, "mismatch/kl": 0.001 * s,
                "mismatch/beyond_band_frac": 0.1, "mismatch/abs_log_ratio/max": 2.0} for s in (1, 2, 3)]
    page = write_report(_write_run(tmp_path / "run", metrics)).read_text()
    assert "Engine/learner mismatch" in _figures(page)
    assert "other-curves" not in page  # every mismatch key is claimed by the panel
