"""``polyrl data CONFIG``: what a run would train and evaluate on, before it trains.

For each task: where its items come from and how many there are (training, held out, skipped, prompts in
both), a few prompts rendered through the model's chat template, prompt lengths in tokens, and the reward
audit (``polyrl.envs.reward_audit``). Nothing is trained or written.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

from polyrl.config import Config
from polyrl.data.items import DatasetSource
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task, env_name, make_task
from polyrl.envs.dataset import DatasetTask
from polyrl.envs.reward_audit import audit_task

LENGTH_SAMPLE = 1000
"""Training prompts measured for the length statistics (the first ones of the stream)."""


def _source_lines(task: Task) -> list[str]:
    source = task.source
    if isinstance(source, DatasetSource):
        s = source.summary()
        split = "a separate held-out set" if source.eval_rows is not None else (
            f"held_out_fraction {task.config.held_out_fraction} of the rows, by hash")
        evaluation = (f"evaluation uses the first {min(task.config.eval_size, s.eval_rows)}" if s.eval_rows
                      else "nothing held out: the task is not evaluated")
        lines = [f"  rows: {s.train_rows} training, {s.eval_rows} held out ({split}); {evaluation}"]
        if s.skipped_rows:
            lines.append(f"  skipped {s.skipped_rows} bad rows (on_bad_row: skip), e.g. {s.first_skips[0]}")
        if source.eval_rows is not None:
            lines.append(f"  prompts in both training and held-out rows: {s.overlap_rows}")
        return lines
    return [f"  items: generated from seeds (training stream unbounded; {task.config.eval_size} held out)"]


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def describe_task(task: Task, tokenizer: Any, echo: Callable[[str], None], prompts: int = 2) -> bool:
    """Print one task's data report; returns whether its reward audit passed (True when it has none)."""
    echo(f"task '{task.name}' (env {env_name(task.config)})")
    for line in _source_lines(task):
        echo(line)
    if isinstance(task, AgentTask):
        echo(f"  first item: {task.train_item(0)}")
        return True
    n = min(LENGTH_SAMPLE, len(task.source) if isinstance(task.source, DatasetSource) else LENGTH_SAMPLE)
    lengths = []
    for i in range(n):
        messages = task.make_env().reset(task.train_item(i))
        text = _render(tokenizer, messages)
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        if i < prompts:
            echo(f"  prompt {i + 1}, as the model sees it:")
            echo("    " + text.rstrip().replace("\n", "\n    "))
    echo(f"  prompt tokens over the first {n} training items: min {min(lengths)}, median {median(lengths):g}, "
         f"max {max(lengths)}")
    if not isinstance(task, DatasetTask):
        return True
    if not task.config.audit.enabled:
        echo("  reward audit: off (audit: false)")
        return True
    result = audit_task(task)
    echo("  " + result.line())
    echo("    row | reference | empty | other row's answer")
    for where, ref, empty, other in result.table[:8]:
        echo(f"    {where} | {ref:g} | {empty:g} | {'-' if other is None else f'{other:g}'}")
    return result.passed


def describe_data(config: Config, tokenizer: Any, echo: Callable[[str], None]) -> bool:
    """Every task's report; True when every audit passed."""
    passed = True
    for task_config in config.tasks:
        task = make_task(task_config, config.train.seed, config.model.system_prompt, tokenizer)
        passed = describe_task(task, tokenizer, echo) and passed
        echo("")
    return passed
