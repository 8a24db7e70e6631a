"""Metric sinks. JSONL is always written (the report and resume read it); TensorBoard when enabled."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write them as null rather than emitting invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink:
    def __init__(self, path: Path, keep_through_step: int | None = None) -> None:
        self.path = path
        if keep_through_step is not None and path.exists():
            # On resume, drop lines written after the checkpoint so the file reads as one uninterrupted run.
            kept = [
                line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= keep_through_step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        elif keep_through_step is None and path.exists():
            path.unlink()
        self._file = open(path, "a")  # noqa: SIM115 - held open for the run

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
