"""``polyrl tasks`` (one line per task or env) and ``polyrl train --dry-run`` (validate, print, estimate)."""

import re

import pytest
from conftest import SMOKE

from polyrl.models.device import native_bf16
from polyrl.observe.catalog import one_line


def polyrl(cli, *args, cwd=None):
    """``polyrl *args`` forked from the tests' server (conftest ``polyrl_cli``)."""
    return cli.run(list(args), cwd=cwd)


@pytest.mark.slow
def test_tasks_lists_every_reasoning_gym_dataset_with_a_description(polyrl_cli):
    from reasoning_gym.factory import DATASETS

    res = polyrl(polyrl_cli, "tasks")
    assert res.returncode == 0, res.stderr
    section = res.stdout.split("reasoning-gym tasks (tasks[].name):\n")[1]
    lines = [line for line in section.splitlines() if line.strip()]
    assert [line.split()[0] for line in lines] == sorted(DATASETS)
    for line in lines:
        name, _, desc = line.strip().partition(" ")
        assert desc.strip(), f"no description for {name}"
        assert len(line) < 140 and "](" not in line  # one short line, markdown links reduced to text
    chain_sum = next(line for line in lines if line.split()[0] == "chain_sum")
    assert "arithmetic" in chain_sum


@pytest.mark.slow
def test_tasks_lists_registered_environments(polyrl_cli):
    from polyrl.observe.catalog import environments

    envs = environments()
    res = polyrl(polyrl_cli, "tasks")
    if envs:
        assert "environments (tasks[].env):" in res.stdout
        for name, desc in envs:
            assert re.search(rf"^  {re.escape(name)} +{re.escape(desc)}$", res.stdout, re.M), name


def test_one_line_descriptions():
    doc = """Generates [Zebra Puzzles](https://x.org/zebra) with
    configurable parameters.

    Longer text that is not shown."""
    assert one_line(doc, "Zebra") == "Generates Zebra Puzzles with configurable parameters."
    assert one_line(None, "ACREDataset") == "ACREDataset"
    long = one_line("word " * 60, "x")
    assert len(long) == 100 and long.endswith("…")


@pytest.mark.slow
def test_dry_run_validates_prints_and_estimates_without_training(polyrl_cli, tmp_path):
    out = tmp_path / "run"
    res = polyrl(polyrl_cli, "train", str(SMOKE), "--dry-run", "--output", str(out), "rollout.group_size=3",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "valid. Resolved config:" in text
    assert "name: smoke" in text and "group_size: 3" in text  # the override is in the resolved config
    # What auto means here is stated: smoke trains in float32 (model.bf16: false); sampling follows the CPU.
    sampling = "bf16" if native_bf16("cpu") else "float32"
    assert (f"Precision on this machine: training float32 (model.bf16: false), sampling {sampling} "
            "(engine.bf16_weights: auto)") in text
    step = re.search(r"step: +<= ([\d.]+) s; 2 steps", text)
    assert step and float(step.group(1)) > 0
    assert re.search(r"samples per step: 6, prompt ~\d+ tokens", text)
    assert re.search(r"update: +[\d.]+ s .*dummy batch of 6 x \d+ tokens", text)
    assert "per decoded token" in text
    peak = re.search(r"peak memory: ~([\d.]+) GB resident", text)
    assert peak and 0.05 < float(peak.group(1)) < 24  # a real figure: at least torch's own footprint
    budget = re.search(r"freed memory stays for reuse until ([\d.]+) GB resident", text)
    assert budget and float(budget.group(1)) > 0
    assert not out.exists() and not (tmp_path / "runs").exists()  # nothing trained or written


@pytest.mark.slow
def test_dry_run_bad_config_is_one_line_naming_the_key(polyrl_cli, tmp_path):
    res = polyrl(polyrl_cli, "train", str(SMOKE), "--dry-run", "rollout.group_size=0")
    assert res.returncode == 2
    assert "rollout.group_size" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_documented_single_turn_task_runs():
    """The example in docs/tasks-and-environments.md, executed as written."""
    from pathlib import Path

    from polyrl.config import TaskConfig
    from polyrl.envs import ENVS, make_task

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tasks-and-environments.md").read_text()
    code = doc.split("<!-- example:start -->\n```python\n")[1].split("```\n<!-- example:end -->")[0]
    try:
        exec(compile(code, "docs/tasks-and-environments.md", "exec"), {})
        task = make_task(TaskConfig(name="times_table"), seed=3)
        item = task.train_item(5)
        assert item == task.train_item(5) and item != task.train_item(6)
        env = task.make_env()
        assert item["question"] in env.reset(item)[0]["content"]
        assert env.step(f"It is {item['answer']}.").reward == 1.0
        env.reset(item)
        assert env.step("no idea").reward == 0.0
        from polyrl.observe.catalog import environments

        assert (
            "times_table",
            "One-digit multiplication questions, scored on the last number of the reply.",
        ) in (environments())
    finally:
        ENVS.pop("times_table", None)
