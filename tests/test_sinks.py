"""Metric sinks: JSONL always, MLflow (local file store) and W&B when enabled, clear errors when missing."""

import json
import logging
import sys
import types

import pytest
from conftest import SMOKE

from polyrl.config import ConfigError
from polyrl.config_check import load_config
from polyrl.observe.metrics import (
    JsonlSink,
    MetricsLogger,
    MlflowSink,
    SinkError,
    WandbSink,
    flatten_config,
    open_metrics_logger,
)

STEP1 = {"reward/mean": 0.25, "kl": None, "entropy": float("nan"), "loss": 1.5, "note": "x", "flag": True}
STEP2 = {"reward/mean": 0.5, "kl": 0.01, "loss": 1.0}


def _mlflow_client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_flatten_config_uses_override_keys():
    data = {"a": {"b": 1}, "tasks": [{"name": "x"}], "betas": [0.9, 0.99]}
    assert flatten_config(data) == {"a.b": 1, "tasks.0.name": "x", "betas": [0.9, 0.99]}


@pytest.mark.slow
def test_mlflow_sink_logs_metrics_and_params_and_resumes(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is the optional 'mlflow' extra (in dev)")
    sink = MlflowSink(tmp_path, None, "exp", "run-a", {"rollout": {"group_size": 4}}, resume=False)
    sink.write(1, STEP1)
    sink.write(2, STEP2)
    sink.close()
    assert sink.uri == f"file:{(tmp_path / 'mlruns').resolve()}"
    client = _mlflow_client(sink.uri)
    run = client.get_run(sink.run_id)
    assert run.data.params == {"rollout.group_size": "4"}
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(sink.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    # None, NaN, text and bools are not metrics.
    assert [m.step for m in client.get_metric_history(sink.run_id, "kl")] == [2]
    assert set(run.data.metrics) == {"reward/mean", "kl", "loss"}

    # A resumed training run appends to the same MLflow run.
    again = MlflowSink(tmp_path, None, "exp", "run-a", {}, resume=True)
    again.write(3, STEP2)
    again.close()
    assert again.run_id == sink.run_id
    assert [m.step for m in client.get_metric_history(sink.run_id, "loss")] == [1, 2, 3]


def test_open_metrics_logger_follows_the_logging_config(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is the optional 'mlflow' extra (in dev)")
    cfg = load_config(SMOKE, ["logging.mlflow=true", "logging.tensorboard=false"])
    logger = open_metrics_logger(cfg, tmp_path)
    assert [type(s).__name__ for s in logger.sinks] == ["JsonlSink", "MlflowSink"]
    logger.write(1, STEP2)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 0.5
    client = _mlflow_client(logger.sinks[1].uri)
    exp = client.get_experiment_by_name("smoke")  # the config name is the default experiment
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["tasks.0.name"] == "chain_sum" and run.data.metrics["kl"] == 0.01

    (tmp_path / "b").mkdir()
    plain = open_metrics_logger(load_config(SMOKE, ["logging.tensorboard=false"]), tmp_path / "b")
    assert [type(s).__name__ for s in plain.sinks] == ["JsonlSink"]
    plain.close()


def test_mlflow_tracking_uri_error_is_one_line(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is the optional 'mlflow' extra (in dev)")
    with pytest.raises(SinkError, match=r"^logging\.mlflow: cannot start an MLflow run at 'nope://x'") as err:
        MlflowSink(tmp_path, "nope://x", "exp", "r", {}, resume=False)
    assert "\n" not in str(err.value)


def test_missing_packages_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        SinkError, match=r"^logging\.mlflow: mlflow is not installed; pip install 'polyrl\[mlflow\]'"
    ):
        MlflowSink(tmp_path, None, "e", "r", {}, resume=False)
    with pytest.raises(
        SinkError, match=r"^logging\.wandb: wandb is not installed; pip install 'polyrl\[wandb\]'"
    ):
        WandbSink(tmp_path, "p", None, "offline", "r", {}, resume=False)
    # The config check runs before any training, without importing the package.
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"logging\.wandb: wandb is not installed") as err:
        load_config(SMOKE, ["logging.wandb=true"])
    assert "\n" not in str(err.value)


class _FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.id, self.logged, self.finished = kwargs, kwargs.get("id") or "abc123", [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def test_wandb_sink_calls(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)

    sink = WandbSink(tmp_path, "proj", "team", "offline", "run-a", {"optim": {"lr": 1e-3}}, resume=False)
    sink.write(1, STEP1)
    sink.close()
    run = runs[0]
    assert (
        run.kwargs["project"] == "proj" and run.kwargs["entity"] == "team" and run.kwargs["mode"] == "offline"
    )
    assert run.kwargs["dir"] == str(tmp_path) and run.kwargs["config"] == {"optim": {"lr": 1e-3}}
    assert run.logged == [(1, {"reward/mean": 0.25, "loss": 1.5})] and run.finished
    assert (tmp_path / "wandb_run_id").read_text().strip() == "abc123"

    WandbSink(tmp_path, "proj", None, None, "run-a", {}, resume=True)
    assert runs[1].kwargs["id"] == "abc123" and runs[1].kwargs["resume"] == "allow"


def test_wandb_init_failure_is_one_line(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("api_key not configured (no-tty).\nCall wandb.login(key=[your_api_key])")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(SinkError) as err:
        WandbSink(tmp_path, "p", None, None, "r", {}, resume=False)
    assert str(err.value).startswith("logging.wandb: cannot start a W&B run: api_key not configured")
    assert "wandb_mode=offline" in str(err.value) and "\n" not in str(err.value)


def test_wandb_offline_for_real(tmp_path):
    pytest.importorskip("wandb", reason="wandb is the optional 'wandb' extra")
    sink = WandbSink(tmp_path, "polyrl-test", None, "offline", "run-a", {"a": 1}, resume=False)
    sink.write(1, STEP2)
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


class _Broken:
    closed = False

    def write(self, step, metrics):
        raise ConnectionError("tracking server went away")

    def close(self):
        self.closed = True


def test_a_failing_optional_sink_is_dropped_not_fatal(tmp_path, caplog):
    broken = _Broken()
    logger = MetricsLogger(tmp_path, tensorboard=False, extra=[broken])
    with caplog.at_level(logging.WARNING):
        logger.write(1, STEP2)
        logger.write(2, STEP2)
    logger.close()
    assert broken.closed and broken not in logger.sinks
    assert sum("tracking server went away" in r.getMessage() for r in caplog.records) == 1
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_jsonl_failure_is_not_swallowed(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.sinks[0]._file.close()
    with pytest.raises(ValueError):
        logger.write(1, STEP2)
    assert isinstance(logger.sinks[0], JsonlSink)
