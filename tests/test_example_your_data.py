"""examples/your_data run as docs/your-data.md shows it, on the tiny model: make the data, look at it, train.

The page's commands, its reward and config, and the ``polyrl data`` output it shows are checked against what
runs here, so the page and the example cannot drift apart."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "your_data"
DOC = ROOT / "docs" / "your-data.md"

TRAIN_TINY = ["model.name=tiny-random", "model.bf16=false", "train.steps=2", "rollout.max_new_tokens=8",
              "tasks.0.eval_size=4", "algorithm.sampling.dynamic=false", "eval.batch_size=4",
              "logging.report=false"]
COMMANDS = [  # as the page shows them, then the overrides that put them on the tiny model
    ("python make_data.py", []),
    ("polyrl data config.yaml", ["model.name=tiny-random"]),
    ("polyrl train config.yaml", TRAIN_TINY),
]


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)


def doc_commands() -> list[str]:
    """Every ``polyrl ...`` or ``python make_data.py`` line in the page's bash blocks, comments dropped."""
    lines = [line.split(" #", 1)[0].strip() for block in doc_blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line.startswith(("polyrl ", "python make_data.py"))]


def run(command: str, overrides: list[str], cwd: Path, polyrl_cli) -> subprocess.CompletedProcess:
    """``python ...`` in a fresh interpreter; ``polyrl ...`` forked from the tests' server (conftest)."""
    argv = shlex.split(command)
    if argv[0] == "polyrl":
        return polyrl_cli.run([*argv[1:], *overrides], cwd=cwd, timeout=300)
    return subprocess.run([sys.executable, *argv[1:], *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_the_page_shows_the_commands_the_reward_and_the_config_that_run_here():
    assert sorted(set(doc_commands())) == sorted(c for c, _ in COMMANDS)
    text = DOC.read_text()
    assert (EXAMPLE / "reward.py").read_text().strip() in text
    config = (EXAMPLE / "config.yaml").read_text()
    tasks = re.search(r"^tasks:\n(?:  .*\n)+", config, flags=re.M).group(0)
    assert tasks in text, "the page's tasks block is not config.yaml's"


@pytest.mark.slow
def test_the_example_runs_as_the_page_shows(tmp_path, polyrl_cli):
    work = tmp_path / "your_data"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("qa.jsonl", "runs", "__pycache__"))
    results = {}
    for command, overrides in COMMANDS:
        res = run(command, overrides, work, polyrl_cli)
        assert res.returncode == 0, f"{command}: {res.stderr[-2000:]}"
        results[command] = res
    assert "wrote 2000 rows to qa.jsonl" in results["python make_data.py"].stdout
    rows = [json.loads(line) for line in (work / "qa.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["question"] for r in rows}) == 2000 and any(r["answer"].startswith("-") for r in rows)
    # The tiny model shares SmolLM2's tokenizer and chat template, so its report is the one the page shows.
    data = results["polyrl data config.yaml"].stdout
    assert "reward audit passed on 16 rows" in data
    shown = [b for b in doc_blocks("text") if b.startswith("task 'qa' (env dataset)")]
    assert shown and shown[0].strip() == data.strip(), "the page's `polyrl data` output is not what it prints"
    summary = json.loads((work / "runs" / "your_data" / "summary.json").read_text())
    assert set(summary["eval_before"]) == {"qa"} and set(summary["eval_after"]) == {"qa"}
    assert summary["steps"] == 2
    assert (work / "runs" / "your_data" / "checkpoints" / "step-2" / "model.safetensors").exists()
    assert "held-out accuracy" in results["polyrl train config.yaml"].stdout
