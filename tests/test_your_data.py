"""Your data: rows from .jsonl, .json, .csv, .parquet, .arrow, a ``datasets`` folder or a glob of shards; the
held-out split and epochs; prompts from templates, chat messages or questions; one-line errors naming the
file, line and field; envs and agents playing your rows; ``polyrl data``; and two runs on the tiny model with
verl-format and TRL-format data and their rewards unchanged."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from polyrl.config import ConfigError, TaskConfig
from polyrl.config_check import load_config
from polyrl.data.files import RowError, open_rows
from polyrl.data.sampler import TaskSampler
from polyrl.envs import make_task
from polyrl.envs.agent import AgentTask
from polyrl.envs.dataset import DatasetTask
from polyrl.observe.data_report import describe_data
from polyrl.parallel.group import contiguous_shards

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}
ROWS = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i), "topic": f"t{i % 3}"} for i in range(12)]


def write_jsonl(path: Path, rows: list, raw: list[str] | None = None) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in raw or []))
    return path


def write_format(fmt: str, folder: Path, rows: list[dict]) -> str:
    """``rows`` written as ``fmt``; returns what ``items`` names."""
    if fmt == "jsonl":
        return str(write_jsonl(folder / "rows.jsonl", rows))
    if fmt == "json":
        (folder / "rows.json").write_text(json.dumps(rows, indent=1))
        return str(folder / "rows.json")
    if fmt == "csv":
        with open(folder / "rows.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return str(folder / "rows.csv")
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), folder / "rows.parquet", row_group_size=5)
        return str(folder / "rows.parquet")
    if fmt == "arrow":
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(str(folder / "rows.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
        return str(folder / "rows.arrow")
    if fmt == "datasets":
        from datasets import Dataset

        Dataset.from_list(rows).save_to_disk(str(folder / "saved"), num_shards=2)
        return str(folder / "saved")
    assert fmt == "glob"
    half = len(rows) // 2
    write_jsonl(folder / "train-00001.jsonl", rows[half:])
    write_jsonl(folder / "train-00000.jsonl", rows[:half])
    (folder / "other.jsonl").write_text('{"question": "not a shard", "answer": "0"}\n')
    return str(folder / "train-*.jsonl")


def dataset_task(items, seed: int = 0, system_prompt: str | None = None, **config) -> DatasetTask:
    task = make_task(TaskConfig(name="qa", items=items, **config), seed, system_prompt)
    assert isinstance(task, DatasetTask)
    return task


def training_rows(task) -> list[dict]:
    """One epoch of the task's training stream (every training row once)."""
    return [task.train_item(i) for i in range(len(task.source))]


def by_question(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["question"])


# --- 1. formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "arrow", "datasets", "glob"])
def test_every_format_gives_the_same_rows(fmt, tmp_path):
    source = write_format(fmt, tmp_path, ROWS)
    rows = open_rows(source, "items")
    assert len(rows) == len(ROWS)
    assert [rows[i] for i in range(len(rows))] == ROWS  # random access, in file (shard) order
    assert list(rows.scan()) == ROWS  # the sequential pass
    assert rows[7] == ROWS[7] and rows[2] == ROWS[2]  # out of order: across record batches and shards
    where = rows.where(len(ROWS) - 1)
    assert ("train-00001.jsonl" if fmt == "glob" else Path(source).name) in where
    # through a task: every row trains (no held-out split), as a prompt and an answer
    task = dataset_task(source, held_out_fraction=0.0)
    assert by_question(training_rows(task)) == by_question(ROWS)
    assert task.make_env().reset(ROWS[3]) == [{"role": "user", "content": "What is 3 plus 3?"}]


def test_a_csv_saved_with_a_byte_order_mark_reads_the_same_rows(tmp_path):
    """Excel's "CSV UTF-8" and many Windows tools start the file with a BOM (.jsonl files with one read fine)."""
    with open(tmp_path / "excel.csv", "w", newline="", encoding="utf-8-sig") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    assert open_rows(str(tmp_path / "excel.csv"), "items").columns() == ["question", "answer", "topic"]
    task = dataset_task(str(tmp_path / "excel.csv"), held_out_fraction=0.0)
    assert by_question(training_rows(task)) == by_question(ROWS)


# --- 2. the held-out split and epochs ------------------------------------------------------------------------


def test_held_out_rows_never_share_a_prompt_with_training_rows(tmp_path):
    rows = [{"question": f"question {i % 150}", "answer": str(i)} for i in range(200)]  # 50 prompts twice
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    task = dataset_task(str(path), held_out_fraction=0.25)
    train_q = {r["question"] for r in training_rows(task)}
    held = task.eval_items(1000)
    held_q = {r["question"] for r in held}
    assert not train_q & held_q
    assert train_q | held_q == {r["question"] for r in rows}
    assert len(training_rows(task)) + len(held) == 200
    assert 20 <= len(held_q) <= 60  # about a quarter of 150 prompts
    summary = task.source.summary()
    assert (summary.train_rows, summary.eval_rows, summary.skipped_rows) == (200 - len(held), len(held), 0)
    assert task.eval_items(3) == held[:3] == task.eval_items(3)  # the first held-out rows, every time
    assert task.eval_items() == held[:task.config.eval_size]

    # the split depends on the rows and split_seed, not on the run's seed
    other_run = dataset_task(str(path), seed=1, held_out_fraction=0.25)
    assert other_run.eval_items(1000) == held
    assert [r["question"] for r in training_rows(other_run)] != [r["question"] for r in training_rows(task)]
    moved = dataset_task(str(path), held_out_fraction=0.25, split_seed=1)
    moved_q = {r["question"] for r in moved.eval_items(1000)}
    assert moved_q != held_q and not moved_q & {r["question"] for r in training_rows(moved)}


def test_a_separate_held_out_file_counts_prompts_in_both(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held = [ROWS[3], {**ROWS[7], "answer": "different"}, *({"question": f"held {i}", "answer": "1"} for i in range(4))]
    held_path = write_jsonl(tmp_path / "held.jsonl", held)
    task = dataset_task(str(train), eval_items=str(held_path), held_out_fraction=0.5)
    summary = task.source.summary()
    assert (summary.train_rows, summary.eval_rows, summary.overlap_rows) == (12, 6, 2)
    assert task.eval_items(10) == held  # the held-out file as written; held_out_fraction does not apply to it
    assert by_question(training_rows(task)) == by_question(ROWS)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_epochs_are_seeded_shuffles_of_the_training_rows(fmt, tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(30)]
    path = write_format(fmt, tmp_path, rows)  # parquet: row groups of 5
    task = dataset_task(path, held_out_fraction=0.2)
    source = task.source
    n = len(source)
    train_q = sorted(r["question"] for r in training_rows(task))
    epoch1 = [task.train_item(i)["question"] for i in range(n)]
    epoch2 = [task.train_item(i)["question"] for i in range(n, 2 * n)]
    assert sorted(epoch1) == sorted(epoch2) == train_q and len(set(epoch1)) == n  # each a permutation
    assert epoch1 != epoch2
    assert (source.epoch_of(n - 1), source.epoch_of(n), source.epoch_of(2 * n)) == (0, 1, 2)
    again = dataset_task(path, held_out_fraction=0.2)
    assert [again.train_item(i)["question"] for i in range(2 * n)] == epoch1 + epoch2
    assert [again.train_item(i)["question"] for i in reversed(range(n))] == epoch1[::-1]  # random access
    other_seed = dataset_task(path, seed=3, held_out_fraction=0.2)
    assert [other_seed.train_item(i)["question"] for i in range(n)] != epoch1
    if fmt == "parquet":  # a row group is read once an epoch: its rows come together
        groups = [int(q[1:]) // 5 for q in epoch1]
        runs = [g for k, g in enumerate(groups) if k == 0 or groups[k - 1] != g]
        assert len(runs) == len(set(groups))
        return
    line = source.train_where(0)
    assert line.startswith(f"{path}: line ")
    assert json.loads(Path(path).read_text().splitlines()[int(line.rsplit(" ", 1)[1]) - 1])["question"] == epoch1[0]


def test_two_ranks_each_building_its_own_task_draw_every_row_once_an_epoch(tmp_path):
    """As learner ranks and Ray workers do: each builds the task and the sampler itself, draws the step's requests
    and rolls out its contiguous share of them; across ranks an epoch is every training row once."""
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(37)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    ranks = [(dataset_task(str(path), held_out_fraction=0.2), TaskSampler({"qa": 1.0}, seed=0)) for _ in range(2)]
    n = len(ranks[0][0].source)
    seen: list[str] = []
    for step in range(1, 100):
        for k, (task, sampler) in enumerate(ranks):
            draws = sampler.draw(step, 4)
            lo, hi = contiguous_shards(len(draws), len(ranks))[k]
            seen += [task.train_item(d.index)["question"] for d in draws[lo:hi]]
        if len(seen) >= n:
            break
    assert sorted(seen[:n]) == sorted(r["question"] for r in training_rows(ranks[0][0]))


def test_held_out_fraction_zero_trains_on_every_row_and_has_no_eval_items(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", ROWS)
    task = dataset_task(str(path), held_out_fraction=0.0)
    assert not task.has_eval_items
    assert task.source.summary().eval_rows == 0 and len(task.source) == len(ROWS)
    with pytest.raises(ValueError, match="no held-out items"):
        task.eval_items(4)


# --- 3. prompts ----------------------------------------------------------------------------------------------


def test_a_prompt_template_fills_fields_and_nested_fields():
    row = {"question": "What is 2+2?", "extra_info": {"x": "think first", "y": 3}, "answer": "4"}
    task = dataset_task([row, {**row, "question": "What is 3+3?"}], prompt="{question} ({extra_info[x]})",
                        prompt_suffix=" Answer with a number.", held_out_fraction=0.0)
    assert task.make_env().reset(row) == [{"role": "user",
                                           "content": "What is 2+2? (think first) Answer with a number."}]


def test_chat_messages_from_a_verl_style_prompt_field_or_a_named_field():
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]
    verl = {"data_source": "toy", "prompt": conversation, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "train", "index": 0}}
    task = dataset_task([verl, {**verl, "prompt": conversation[1:]}], held_out_fraction=0.0,
                        prompt_suffix=" Be quick.", system_prompt="Ignored: the row has its own.")
    assert task.make_env().reset(verl) == [conversation[0], {"role": "user", "content": "2+2? Be quick."}]
    assert task.make_env().reset({**verl, "prompt": conversation[1:]}) == [
        {"role": "system", "content": "Ignored: the row has its own."}, {"role": "user", "content": "2+2? Be quick."}]
    assert task.format.answer(verl) == "4"  # verl's reward_model.ground_truth, found without answer_field

    chat = {"conversation": [*conversation, {"role": "assistant", "content": "4"}], "answer": "4"}
    named = dataset_task([chat], messages_field="conversation", held_out_fraction=0.0)
    assert named.make_env().reset(chat) == conversation  # a trailing reference reply is not part of the prompt


def test_the_question_field_a_trl_prompt_column_and_the_system_prompt():
    row = {"question": "Name a colour.", "answer": "red"}
    task = dataset_task([row], held_out_fraction=0.0, system_prompt="Be brief.")
    assert task.make_env().reset(row) == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name a colour."}]
    trl = {"prompt": "Name a fruit.", "solution": "apple"}
    task = dataset_task([trl], answer_field="solution", held_out_fraction=0.0)
    assert task.make_env().reset(trl) == [{"role": "user", "content": "Name a fruit."}]
    assert task.format.answer(trl) == "apple"
    custom = {"text": "Name a tree.", "answer": "oak"}
    task = dataset_task([custom], question_field="text", held_out_fraction=0.0)
    assert task.make_env().reset(custom) == [{"role": "user", "content": "Name a tree."}]


def test_the_config_system_prompt_reaches_the_rendered_prompt(tok):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    cfg = load_config(None, data={**TINY, "model": {**TINY["model"], "system_prompt": "You add numbers."},
                                  "tasks": [{"name": "add", "items": rows, "held_out_fraction": 0.0}]})
    lines: list[str] = []
    assert describe_data(cfg, tok, lines.append)
    text = "\n".join(lines)
    assert "You add numbers." in text and "What is" in text
    assert text.index("You add numbers.") < text.index("What is")
    assert "rows: 6 training, 0 held out" in text and "reward audit passed on 6 rows" in text


# --- 4. bad input: one line naming the file, the line and the field -------------------------------------------

GOOD = '{"question": "What is 1?", "answer": "1", "topic": "a"}'
BAD_ROWS = {
    "bad json": ([GOOD, "", '{"question": "What is 2?", '], {}, ["line 3", "not valid JSON"]),
    "a list": ([GOOD, "[1, 2]"], {}, ["line 2", "the row is a list, not an object"]),
    "template field": ([GOOD, '{"question": "q", "answer": "2"}'], {"prompt": "{question} about {topic}"},
                       ["line 2", "no field 'topic'", "prompt"]),
    "question type": ([GOOD, '{"question": 5, "answer": "5"}'], {}, ["line 2", "field 'question' is a int"]),
    "no answer": ([GOOD, GOOD, '{"question": "What is 3?"}'], {}, ["line 3", "no field 'answer'"]),
    "messages": (['{"chat": [{"role": "user", "content": "hi"}], "answer": "1"}', '{"chat": "hi", "answer": "1"}'],
                 {"messages_field": "chat"},
                 ["line 2", "field 'chat' is not a list of chat messages"]),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_file_line_and_field(case, tmp_path):
    lines, config, expected = BAD_ROWS[case]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RowError) as err:
        dataset_task(str(path), held_out_fraction=0.0, **config)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: line ")
    for part in expected:
        assert part in message, (part, message)
    assert "on_bad_row: skip" in message  # says how to go on without the row


def test_on_bad_row_skip_counts_the_skipped_rows(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([GOOD, "not json", GOOD.replace("1", "2"), "[3]", '{"question": "q"}',
                               GOOD.replace("1", "4")]) + "\n")
    task = dataset_task(str(path), held_out_fraction=0.0, on_bad_row="skip")
    summary = task.source.summary()
    assert (summary.train_rows, summary.skipped_rows) == (3, 3)
    assert [s.split(": ")[1] for s in summary.first_skips] == ["line 2", "line 4", "line 5"]
    assert "no field 'answer'" in summary.first_skips[2]
    assert sorted(r["answer"] for r in training_rows(task)) == ["1", "2", "4"]


def test_a_bad_csv_line_and_an_unreadable_file_are_one_line(tmp_path):
    (tmp_path / "bad.csv").write_text("question,answer\nq1,1\nq2,2,extra\n")
    with pytest.raises(RowError, match=r"bad\.csv: line 3 has more cells than the header's 2 columns") as err:
        open_rows(str(tmp_path / "bad.csv"), "items")
    assert "\n" not in str(err.value)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all\n" * 3)
    with pytest.raises(RowError, match=r"^items: cannot read '.*bad\.parquet'") as err:
        open_rows(str(tmp_path / "bad.parquet"), "items")
    assert "\n" not in str(err.value)
    (tmp_path / "rows.txt").write_text("a\n")
    with pytest.raises(RowError, match=r"rows\.txt: unknown dataset format '\.txt'; use \.jsonl"):
        open_rows(str(tmp_path / "rows.txt"), "items")


@pytest.mark.parametrize(("items", "expected"), [
    ("missing.jsonl", "tasks.0.items: no such file 'missing.jsonl'"),
    ("shards/train-*.parquet", "tasks.0.items: no file matches 'shards/train-*.parquet'"),
])
def test_a_missing_file_or_an_empty_glob_fails_when_the_config_loads(items, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train-0.jsonl").write_text(GOOD + "\n")  # a shard, but not a parquet one
    with pytest.raises(ConfigError) as err:
        load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": items}]})
    assert expected in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="tasks.0.eval_items: no such file 'held.jsonl'"):
        load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": "shards/train-0.jsonl",
                                                   "eval_items": "held.jsonl"}]})


def _run_dir_with_an_earlier_run(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    run_dir = tmp_path / "RUN_DIR"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("sentinel: an earlier run's config\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    return run_dir, {p.name: p.read_bytes() for p in run_dir.iterdir()}


@pytest.mark.slow
def test_polyrl_train_exits_2_with_one_line_and_leaves_the_run_dir_alone(tmp_path, polyrl_cli):
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    config = {**TINY, "name": "bad_reward", "train": {"steps": 2},
              "tasks": [{"name": "qa", "items": "data.jsonl", "reward": "yourdata_no_such_module:score"}]}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    run_dir, before = _run_dir_with_an_earlier_run(tmp_path)
    proc = polyrl_cli.run(["train", "cfg.yaml", "-o", "RUN_DIR"], cwd=tmp_path, timeout=120)  # forked (conftest)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: cfg.yaml: tasks.0.reward: no module named 'yourdata_no_such_module' "
        f"(looked in {tmp_path} and the installed packages)"], proc.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


@pytest.mark.slow
def test_a_bad_row_or_a_failed_audit_stops_training_before_the_run_dir_is_touched(tmp_path, monkeypatch):
    """The CLI turns these ValueErrors into exit 2 as above; here in-process. Slow: the model and engine are
    built before the rows are audited (and the engine waits for the native kernels' build on a cold cache)."""
    from polyrl.run.loop import train

    monkeypatch.chdir(tmp_path)
    run_dir, before = _run_dir_with_an_earlier_run(tmp_path)
    write_jsonl(tmp_path / "data.jsonl", [{"question": "What is 1+1?", "answer": "2"}, {"question": "What is 2+2?"}])
    cfg = load_config(None, data={**TINY, **RUN, "tasks": [{"name": "qa", "items": "data.jsonl"}]})
    with pytest.raises(RowError) as err:
        train(cfg, run_dir, log=lambda m: None)
    assert "\n" not in str(err.value) and str(err.value).startswith("data.jsonl: line 2: no field 'answer'")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before

    (tmp_path / "yourdata_one_reward.py").write_text("def score(completion, item):\n    return 1.0\n")
    cfg = load_config(None, data={**TINY, **RUN, "tasks": [{"name": "qa", "items": ROWS,
                                                             "reward": "yourdata_one_reward:score"}]})
    with pytest.raises(ValueError, match="reward audit failed: an empty reply scored the top reward 1") as err:
        train(cfg, run_dir, log=lambda m: None)
    assert "\n" not in str(err.value) and "task.items: row " in str(err.value)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


# --- 8. envs and agents playing your rows ---------------------------------------------------------------------

MY_ENV = '''
from polyrl.envs.base import Env, StepResult, Task

RESETS = []


class EchoEnv(Env):
    def reset(self, item):
        RESETS.append(item)
        self.item = item
        return [{"role": "user", "content": "Q: " + item["question"]}]

    def step(self, reply):
        reward = float(reply.strip() == self.item["answer"])
        return StepResult([], reward, True, {"score": reward})


def make(config, ctx):
    """An env of my own that would make its own items."""
    return Task(config, EchoEnv, make_item=lambda i: {"question": f"generated {i}", "answer": "0"}, seed=ctx.seed)
'''


def test_an_env_of_your_own_plays_your_rows(tmp_path, monkeypatch):
    (tmp_path / "yourdata_my_env.py").write_text(MY_ENV)
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"What is {i} + 0?", "answer": str(i), "id": i} for i in range(20)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "mine", "env": "yourdata_my_env:make", "items": str(path),
                                                     "held_out_fraction": 0.3}]})
    task = make_task(cfg.tasks[0], seed=0)
    module = sys.modules["yourdata_my_env"]
    played = training_rows(task)
    held = task.eval_items(100)
    assert by_question(played + held) == by_question(rows)  # every row, none generated
    assert held and not {r["question"] for r in played} & {r["question"] for r in held}
    env = task.make_env()
    assert env.reset(played[0]) == [{"role": "user", "content": "Q: " + played[0]["question"]}]
    assert module.RESETS[-1] == played[0] and "id" in module.RESETS[-1]  # reset gets the whole row
    assert env.step(played[0]["answer"]).reward == 1.0
    # without items the env makes its own
    own = make_task(TaskConfig(name="mine", env="yourdata_my_env:make"), seed=0)
    assert own.train_item(0)["question"] == "generated 0"


def test_tool_math_plays_your_rows(tmp_path):
    rows = [{"question": "What is 3 + 4?", "answer": "7"}, {"question": "What is 5 * 6?", "answer": "30"}]
    path = write_jsonl(tmp_path / "arith.jsonl", rows)
    task = make_task(TaskConfig(name="tm", env="tool_math", items=str(path), held_out_fraction=0.0,
                                prompt_suffix=" Just the number."), seed=0)
    assert by_question(training_rows(task)) == by_question(rows)
    env = task.make_env()
    messages = env.reset(rows[1])
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user",
                                                                 "content": "What is 5 * 6? Just the number."}
    assert env.step("30").reward == 1.0
    with pytest.raises(ConfigError, match="tasks.0.reward: the env 'tool_math' scores its own episodes"):
        load_config(None, data={**TINY, "tasks": [{"name": "tm", "env": "tool_math", "items": str(path),
                                                   "reward": "exact"}]})


def test_reward_on_an_agent_task_is_an_error_not_ignored(tmp_path, monkeypatch):
    """An agent returns its own reward, so ``reward:`` there would be silently unused (as on tool_math, where it
    is an error)."""
    (tmp_path / "yourdata_agent_r.py").write_text("async def run(client, item):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"tasks\.0\.reward: ") as err:
        load_config(None, data={**TINY, "tasks": [{"name": "ag", "agent": "yourdata_agent_r:run",
                                                   "items": [{"question": "q", "answer": "1"}], "reward": "exact"}]})
    assert "\n" not in str(err.value)


def test_an_agent_task_takes_its_items_from_a_jsonl_file(tmp_path, monkeypatch):
    (tmp_path / "yourdata_agent.py").write_text("async def run(client, item):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"task {i}", "answer": str(i)} for i in range(16)]
    write_jsonl(tmp_path / "agent_items.jsonl", rows)
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "ag", "agent": "yourdata_agent:run",
                                                     "items": "agent_items.jsonl", "held_out_fraction": 0.25}]})
    task = make_task(cfg.tasks[0], seed=0)
    assert isinstance(task, AgentTask)
    played, held = training_rows(task), task.eval_items(100)
    assert held and by_question(played + held) == by_question(rows)
    assert task.source.train_where(0).startswith("agent_items.jsonl: line ")


# --- 9. polyrl data -------------------------------------------------------------------------------------------


def _data_cli(polyrl_cli, tmp_path: Path, task: dict) -> subprocess.CompletedProcess:
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    write_jsonl(tmp_path / "qa.jsonl", rows)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**TINY, "tasks": [{"name": "qa", "items": "qa.jsonl",
                                                                          "held_out_fraction": 0.3, **task}]}))
    return polyrl_cli.run(["data", "cfg.yaml"], cwd=tmp_path, timeout=120)  # the command line, forked (conftest)


@pytest.mark.slow
def test_polyrl_data_shows_rows_prompts_lengths_and_the_audit(tmp_path, polyrl_cli):
    proc = _data_cli(polyrl_cli, tmp_path, {"prompt_suffix": " Reply with the number."})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "task 'qa' (env dataset)" in out
    rows = next(line for line in out.splitlines() if "rows:" in line)
    train, held = (int(x) for x in (rows.split("rows: ")[1].split(" training, ")[0],
                                     rows.split(" training, ")[1].split(" held out")[0]))
    assert train + held == 10 and held > 0
    assert "prompt 1, as the model sees it:" in out and "Reply with the number." in out and "What is" in out
    assert f"prompt tokens over the first {train} training items" in out
    assert "reward audit passed" in out


@pytest.mark.slow
def test_polyrl_data_exits_1_when_the_audit_fails(tmp_path, polyrl_cli):
    (tmp_path / "zero_reward.py").write_text("def score(completion, item):\n    return 0.0\n")
    proc = _data_cli(polyrl_cli, tmp_path, {"reward": "zero_reward:score"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reward audit failed" in proc.stdout and "every reply scored 0" in proc.stdout
    assert "qa.jsonl: line" in proc.stdout


# --- 7. training on verl-format and TRL-format data -----------------------------------------------------------

VERL_REWARD = '''
import re


def extract_solution(solution_str):
    # verl's gsm8k-style extraction: the text after "####", else the last number
    match = re.search(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    if match is not None:
        return match.group(1).replace(",", "")
    numbers = re.findall(r"-?[0-9]+(?:\\.[0-9]+)?", solution_str)
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "toy/add" and extra_info["split"] == "train"
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth else 0.0
'''

TRL_REWARD = '''
def accuracy_reward(completions, solution, **kwargs):
    """TRL's shape: conversational completions, the dataset's columns as keyword lists."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if content.strip() == sol.strip() else 0.0 for content, sol in zip(contents, solution)]
'''

RUN = {"train": {"steps": 2}, "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4}}


def _train(tmp_path: Path, task: dict, tok, prompts: set[str]) -> tuple[dict, list[dict], list[str]]:
    from polyrl.run.loop import train

    task = {"eval_size": 4, "held_out_fraction": 0.25, **task}
    cfg = load_config(None, data={**TINY, **RUN, "tasks": [task]})
    logged: list[str] = []
    summary = train(cfg, tmp_path / "run", log=logged.append)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and f"reward/{task['name']}" in m for m in metrics)
    assert "reward/errors" not in metrics[0] and "reward/errors" not in metrics[1]
    assert summary["steps"] == 2 and set(summary["eval_before"]) == set(summary["eval_after"]) == {task["name"]}
    assert any(f"task '{task['name']}': reward audit passed" in line for line in logged), logged
    stored = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(stored) == 4 and {t["task"] for t in stored} == {task["name"]}
    for t in stored:  # each episode's prompt is one of the file's rows, scored by the function (0 or 1 here)
        assert t["reward"] in (0.0, 1.0) and "reward_error" not in t["info"]
        assert any(p in tok.decode(t["input_ids"][: t["turn_spans"][0][0]]) for p in prompts)
    return summary, metrics, logged


@pytest.mark.slow
def test_verl_parquet_and_verl_compute_score_train_unchanged(tmp_path, monkeypatch, one_thread, tok):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    instruction = "Let's think step by step and output the final answer after \"####\"."
    rows = [{"data_source": "toy/add",
             "prompt": [{"role": "user", "content": f"What is {i} + {i + 3}? {instruction}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)},
             "extra_info": {"split": "train", "index": i}} for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    _train(tmp_path, {"name": "verl_add", "items": "train.parquet", "reward": "verl_reward.py:compute_score"}, tok,
           {r["prompt"][0]["content"] for r in rows})
    assert (tmp_path / "run" / "config.yaml").exists()


def test_trl_datasets_folder_and_trl_accuracy_reward_train(tmp_path, monkeypatch, one_thread, tok):
    from datasets import Dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "yourdata_trl_rewards.py").write_text(TRL_REWARD)
    rows = [{"prompt": [{"role": "user", "content": f"Spell the number {i} in digits."}], "solution": str(i)}
            for i in range(24)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "trl_data"))
    _train(tmp_path, {"name": "trl_spell", "items": "trl_data", "reward": "yourdata_trl_rewards:accuracy_reward",
                      "answer_field": "solution"}, tok, {r["prompt"][0]["content"] for r in rows})


FLAKY_REWARD = '''
def score(completion, item):
    """Scores numbers; raises on anything else (the random model's replies)."""
    text = completion.strip()
    if text == item["answer"]:
        return 1.0
    if text == "" or text.isdigit():
        return 0.0
    raise ValueError(f"cannot read a number in {text!r}\\nsecond line")
'''


def test_a_reward_that_raises_during_training_scores_zero_and_is_counted(tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "yourdata_flaky.py").write_text(FLAKY_REWARD)
    from polyrl.run.loop import train

    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]
    cfg = load_config(None, data={**TINY, **RUN, "eval": {"before": False, "after": False},
                                  "tasks": [{"name": "flaky", "items": rows, "reward": "yourdata_flaky:score"}]})
    logged: list[str] = []
    train(cfg, tmp_path / "run", log=logged.append)
    assert any("task 'flaky': reward audit passed" in line for line in logged)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    stored = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    failed = [t for t in stored if "reward_error" in t["info"]]
    assert failed, "the random model's replies should make the reward raise"
    for t in failed:
        assert t["reward"] == 0.0 and t["info"]["reward_error"].startswith("ValueError: cannot read a number in ")
        assert "second line" not in t["info"]["reward_error"]
    assert sum(m.get("reward/errors", 0.0) for m in metrics) >= len(failed)


def test_describe_data_names_a_separate_held_out_file_and_skips(tmp_path, tok):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join([json.dumps(r) for r in ROWS] + ["oops"]) + "\n")
    held = write_jsonl(tmp_path / "held.jsonl", [ROWS[0], {"question": "new", "answer": "1"}])
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": str(train), "eval_items": str(held),
                                                     "on_bad_row": "skip", "audit": False}]})
    lines: list[str] = []
    assert describe_data(cfg, tok, lines.append)
    text = "\n".join(lines)
    assert "rows: 12 training, 2 held out (a separate held-out set)" in text
    assert f"skipped 1 bad rows (on_bad_row: skip), e.g. {train}: line 13" in text
    assert "prompts in both training and held-out rows: 1" in text
    assert "reward audit: off (audit: false)" in text


def test_inline_rows_with_a_template_reach_the_prompt_the_model_sees(tok):
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "qa", "items": ROWS, "held_out_fraction": 0.0,
                                                     "prompt": "Topic {topic}: {question}"}]})
    lines: list[str] = []
    assert describe_data(cfg, tok, lines.append)
    text = "\n".join(lines)
    assert text.count("as the model sees it") == 2
    assert len(re.findall(r"Topic t(\d): What is (\d+) plus \2\?", text)) == 2
