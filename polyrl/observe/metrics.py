"""Metric sinks. JSONL is always written (the report, viewer and resume read it); TensorBoard, MLflow and
Weights & Biases when enabled in ``logging``. The optional sinks import their package lazily."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from polyrl.config import Config

log = logging.getLogger(__name__)


class SinkError(RuntimeError):
    """An optional metric sink could not start; one line that names the ``logging`` key."""


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
        kept, bad = _readable_lines(path, keep_through_step)
        if bad:  # a line torn by a kill mid-write, or a damaged file: named, dropped; the rest is kept
            shown = ", ".join(str(n) for n in bad[:5]) + (" ..." if len(bad) > 5 else "")
            log.warning("%s: %d unreadable line(s) dropped on resume (line %s); %d kept", path, len(bad), shown,
                        len(kept))
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, path)
    elif keep_through_step is None and path.exists():
        path.unlink()
    return open(path, "a")  # noqa: SIM115 - held open for the run


def _readable_lines(path: Path, keep_through_step: int) -> tuple[list[bytes], list[int]]:
    """The lines of a step log up to ``keep_through_step``, as bytes, and the numbers of the lines that are not
    a JSON object with an integer ``step`` (bad UTF-8, bad JSON, a NUL-filled tail)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SinkError(f"{path}: cannot be read to resume the run ({exc.strerror or exc})") from None
    kept, bad = [], []
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
            step = row["step"] if isinstance(row, dict) else None
        except (ValueError, KeyError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            step = None
        if not isinstance(step, int) or isinstance(step, bool):
            bad.append(lineno)
        elif step <= keep_through_step:
            kept.append(line)
    return kept, bad


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


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def flatten_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "l": [{"c": 2}]}`` -> ``{"a.b": 1, "l.0.c": 2}``: the dotted keys of overrides."""
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list | tuple) and any(isinstance(x, dict | list) for x in data):
        items = ((str(i), x) for i, x in enumerate(data))
    else:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten_config(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


class MlflowSink:
    """MLflow tracking through ``MlflowClient`` (no global state); by default a file store in RUN_DIR/mlruns.

    The run id is kept in RUN_DIR/mlflow_run_id, so a resumed training run logs to the same MLflow run.
    """

    def __init__(
        self, run_dir: Path, tracking_uri: str | None, experiment: str, run_name: str,
        params: dict[str, Any], resume: bool,
    ) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise SinkError("logging.mlflow: mlflow is not installed; pip install 'polyrl[mlflow]'") from None
        uri = tracking_uri or f"file:{(run_dir / 'mlruns').resolve()}"
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless opted in; a store that is plain files inside the run dir
            # (no server, no database) is what a laptop run wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric = Metric
        id_file = run_dir / "mlflow_run_id"
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = id_file.read_text().strip() if resume and id_file.exists() else None
            if run_id is None:
                found = self.client.get_experiment_by_name(experiment)
                exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
                run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
                id_file.write_text(run_id + "\n")
                # MLflow caps a value at 6000 characters and a batch at 100 params.
                items = [Param(k, str(v)[:6000]) for k, v in flatten_config(params).items()]
                for i in range(0, len(items), 100):
                    self.client.log_batch(run_id, params=items[i : i + 100])
        except Exception as exc:  # noqa: BLE001 - any store problem becomes one line naming the key
            raise SinkError(
                f"logging.mlflow: cannot start an MLflow run at '{uri}': {_first_line(exc)}"
            ) from None
        self.run_id = run_id
        self.uri = uri

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self._metric(_mlflow_key(k), v, now, step) for k, v in _numeric(metrics).items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . / and space; anything else becomes _.
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class WandbSink:
    """Weights & Biases; the run lives under RUN_DIR/wandb and its id in RUN_DIR/wandb_run_id (for resume)."""

    def __init__(
        self, run_dir: Path, project: str, entity: str | None, mode: str | None, run_name: str,
        params: dict[str, Any], resume: bool,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise SinkError("logging.wandb: wandb is not installed; pip install 'polyrl[wandb]'") from None
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        try:
            self.run = wandb.init(
                project=project, entity=entity, name=run_name, dir=str(run_dir), mode=mode, config=params,
                id=run_id, resume="allow" if run_id else None,
            )
        except Exception as exc:  # noqa: BLE001 - e.g. not logged in: one line, with the way out
            raise SinkError(
                f"logging.wandb: cannot start a W&B run: {_first_line(exc)} "
                "(run `wandb login`, or set logging.wandb_mode=offline)"
            ) from None
        id_file.write_text(self.run.id + "\n")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Writes each step's metrics to every sink. JSONL is the record the report and viewer read, so a failing
    optional sink (a tracking server gone away) is dropped with a warning instead of stopping the run."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        resume_step: int | None = None,
        extra: list | None = None,
    ) -> None:
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        self.sinks.extend(extra or [])

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as exc:
                if isinstance(sink, JsonlSink):
                    raise
                log.warning("metric sink %s failed (%s); it is disabled for the rest of the run",
                            type(sink).__name__, _first_line(exc))
                self.sinks.remove(sink)
                _close_quietly(sink)

    def close(self) -> None:
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.close()
            else:
                _close_quietly(sink)


def _close_quietly(sink: Any) -> None:
    try:
        sink.close()
    except Exception as exc:  # noqa: BLE001 - closing an optional sink must not lose the run
        log.warning("metric sink %s did not close cleanly: %s", type(sink).__name__, _first_line(exc))


def open_metrics_logger(config: Config, run_dir: Path, resume_step: int | None = None) -> MetricsLogger:
    """The sinks ``config.logging`` asks for; raises SinkError (one line) if an optional one cannot start."""
    cfg = config.logging
    params = config.model_dump(mode="json")
    resume = resume_step is not None
    extra: list[Any] = []
    try:
        if cfg.mlflow:
            experiment = cfg.mlflow_experiment or config.name
            extra.append(
                MlflowSink(run_dir, cfg.mlflow_tracking_uri, experiment, run_dir.name, params, resume)
            )
        if cfg.wandb:
            extra.append(WandbSink(
                run_dir, cfg.wandb_project, cfg.wandb_entity, cfg.wandb_mode, run_dir.name, params, resume
            ))
    except SinkError:
        for sink in extra:
            _close_quietly(sink)
        raise
    return MetricsLogger(run_dir, cfg.tensorboard, resume_step, extra)


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
