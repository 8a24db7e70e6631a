"""Metric sinks. JSONL is always written (the report and resume read it); TensorBoard when enabled."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write them as null rather than emitting invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def open_step_log(path: Path, keep_through_step: int | None):
    """Open a JSON-lines file keyed by ``step`` for appending.

    A fresh run (``keep_through_step`` None) starts it empty; a resumed run drops the lines written after its
    checkpoint, so the file reads as one uninterrupted run.
    """
    if keep_through_step is not None and path.exists():
        kept = [
            line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= keep_through_step
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    elif keep_through_step is None and path.exists():
        path.unlink()
    return open(path, "a")  # noqa: SIM115 - held open for the run


class JsonlSink:
    def __init__(self, path: Path, keep_through_step: int | None = None) -> None:
        self.path = path
        self._file = open_step_log(path, keep_through_step)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None = None) -> None:
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TrajectoryWriter:
    """Stores the first ``per_group`` samples of every group each step in trajectories.jsonl."""

    def __init__(self, run_dir: Path, per_group: int, resume_step: int | None = None) -> None:
        self.per_group = per_group
        self._file = open_step_log(run_dir / "trajectories.jsonl", resume_step) if per_group else None

    def write(self, step: int, trajectories: list) -> None:
        if self._file is None:
            return
        seen: dict[int, int] = {}
        for t in trajectories:
            if seen.get(t.group_id, 0) < self.per_group:
                seen[t.group_id] = seen.get(t.group_id, 0) + 1
                self._file.write(json.dumps({"step": step, **asdict(t)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
