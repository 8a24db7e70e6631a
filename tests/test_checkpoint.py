"""Checkpoints: atomic and verified; a torn or corrupt one is named and skipped for the one before."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch
from conftest import SMOKE

from polyrl.checkpoint.store import (
    MANIFEST,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial_saves,
    save_checkpoint,
    verify_checkpoint,
)
from polyrl.config_check import load_config
from polyrl.models.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model("tiny-random", seed=0), load_tokenizer("tiny-random")


@pytest.fixture
def run_dir(tmp_path, model_and_tokenizer):
    """A run dir with whole checkpoints at steps 1, 2 and 3 (keep=3)."""
    model, tok = model_and_tokenizer
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, tok, {"optimizer": {"step": step}}, {"sampler": {}}, keep=3)
    return tmp_path


def _latest(run_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="polyrl.checkpoint.store"):
        return latest_checkpoint(run_dir)


def test_whole_checkpoints_verify_and_the_newest_wins(run_dir, caplog):
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-1", "step-2", "step-3"]
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(run_dir))
    assert _latest(run_dir, caplog).name == "step-3" and not caplog.records


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated weights": (lambda d: _truncate(d / "model.safetensors"), "checksum mismatch in model.safe"),
    "flipped byte": (lambda d: _flip_byte(d / "optimizer.pt"), "checksum mismatch in optimizer.pt"),
    "deleted manifest": (lambda d: (d / MANIFEST).unlink(), f"no {MANIFEST} (torn write)"),
    "truncated manifest": (lambda d: _truncate(d / MANIFEST), f"{MANIFEST} is not valid JSON"),
    "binary manifest": (lambda d: (d / MANIFEST).write_bytes(b"\xff\xfe\x00"), "is not valid JSON"),
    "manifest without files": (lambda d: (d / MANIFEST).write_text('{"step": 3}'), "has no 'files' mapping"),
    "manifest is a list": (lambda d: (d / MANIFEST).write_text("[1, 2]"), "has no 'files' mapping"),
    "empty manifest": (lambda d: (d / MANIFEST).write_text('{"step": 3, "files": {}}'), "lists no files"),
    "deleted file": (lambda d: (d / "rng.pt").unlink(), "missing rng.pt"),
    "file became a dir": (lambda d: ((d / "rng.pt").unlink(), (d / "rng.pt").mkdir()), "missing rng.pt"),
    "copied from another step": (
        lambda d: shutil.copy(d.parent / "step-2" / MANIFEST, d / MANIFEST), "is for step 2, not 3"
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_is_named_and_the_previous_one_used(run_dir, caplog, kind):
    damage, reason = CORRUPTIONS[kind]
    newest = run_dir / "checkpoints" / "step-3"
    damage(newest)
    assert reason in verify_checkpoint(newest)
    assert _latest(run_dir, caplog).name == "step-2"
    [record] = caplog.records
    message = record.getMessage()
    assert message == f"skipping corrupt checkpoint: {newest}: {verify_checkpoint(newest).split(': ', 1)[1]}"
    assert str(newest) in message and reason in message and "\n" not in message


def test_all_corrupt_gives_none(run_dir, caplog):
    for path in list_checkpoints(run_dir):
        (path / MANIFEST).unlink()
    assert _latest(run_dir, caplog) is None
    assert len(caplog.records) == 3


def test_keep_prunes_the_oldest(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, tok, {}, {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-3", "step-4"]


def test_partial_saves_are_ignored_and_removable(run_dir):
    stale = run_dir / "checkpoints" / ".step-4.tmp"
    shutil.copytree(run_dir / "checkpoints" / "step-3", stale)
    assert [p.name for p in list_checkpoints(run_dir)][-1] == "step-3"
    assert remove_partial_saves(run_dir) == [stale] and not stale.exists()
    assert remove_partial_saves(run_dir / "nowhere") == []


def test_load_restores_weights_and_rng_exactly(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    torch.manual_seed(123)
    random.seed(123)
    sampler = {"sampler": {"cursors": {"a": 5}}}
    path = save_checkpoint(tmp_path, 7, model, tok, {"optimizer": {"x": 1}}, sampler)
    expected_torch, expected_py = torch.rand(3), random.random()
    other = load_model("tiny-random", seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    optimizer_state, state = load_checkpoint(path, other)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert optimizer_state == {"optimizer": {"x": 1}} and state == {"step": 7, **sampler}


@pytest.mark.slow
def test_training_resumes_past_a_torn_checkpoint(tmp_path, caplog):
    """train(resume=True) skips a torn newest checkpoint, names it, and reproduces the uninterrupted run."""
    from polyrl.run.loop import train

    overrides = ["train.steps=2", "eval.before=false", "eval.after=false", "logging.tensorboard=false",
                 "logging.report=false", "rollout.group_size=2", "algorithm.regularisers.entropy_coef=0.01"]
    cfg = load_config(SMOKE, overrides)
    run = tmp_path / "run"
    train(cfg, run, log=lambda m: None)
    reference = (run / "metrics.jsonl").read_text().splitlines()
    torn = run / "checkpoints" / "step-2"
    _truncate(torn / "model.safetensors")
    messages = []
    with caplog.at_level(logging.WARNING, logger="polyrl.checkpoint.store"):
        train(cfg, run, resume=True, log=messages.append)
    assert any(f"{torn}: checksum mismatch in model.safetensors" in r.getMessage() for r in caplog.records)
    assert messages[0] == f"resumed from {run / 'checkpoints' / 'step-1'} (step 1)"
    resumed = (run / "metrics.jsonl").read_text().splitlines()

    def strip(lines):
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")} for x in lines]

    assert strip(resumed) == strip(reference)
    assert verify_checkpoint(torn) is None  # step 2 was trained again and saved whole
