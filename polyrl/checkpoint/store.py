"""Checkpoints that resume exactly: weights in HF format (full policy or LoRA adapter), optimizer and scheduler,
RNG states and sampler state, written atomically (temp dir, fsync, rename) with a manifest of checksums.

A torn or corrupt checkpoint fails its checksum; ``latest_checkpoint`` names it and falls back to the one before.
A save that fails (a full disk) removes its temp dir and raises ``CheckpointError``; the checkpoints before it
are untouched, since old ones are pruned only after a new one is in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from polyrl.checkpoint import faults

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the message names the one a resume uses."""

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # GPU dropout (LoRA) draws from these
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write ``checkpoints/step-N`` atomically; keep only the newest ``keep`` checkpoints. A failed write
    (``OSError``: a full disk, a quota) raises ``CheckpointError`` and leaves the earlier checkpoints as they
    were."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    try:
        _write_files(tmp, step, model, tokenizer, optimizer_state, state)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
        earlier = [p for p in list_checkpoints(run_dir) if p != final and verify_checkpoint(p) is None]
        kept = f"{earlier[-1]} is intact; --resume continues from it" if earlier else "no earlier checkpoint exists"
        raise CheckpointError(f"{final}: checkpoint not written ({exc.strerror or exc}); {kept}") from exc
    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    faults.point("ckpt_renamed", step)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_files(tmp: Path, step: int, model, tokenizer, optimizer_state: dict, state: dict[str, Any]) -> None:
    """Every file of a checkpoint and its manifest into ``tmp``, fsynced."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    faults.point("ckpt_weights", step)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    faults.point("ckpt_files", step)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for p in [*files, tmp / MANIFEST]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    faults.point("ckpt_manifest", step)


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is whole, else a one-line reason."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return f"{path}: no {MANIFEST} (torn write)"
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except ValueError:  # bad JSON or bad UTF-8
        return f"{path}: {MANIFEST} is not valid JSON"
    try:
        entries = [(str(name), digest) for name, digest in manifest["files"].items()]
    except (TypeError, KeyError, AttributeError):
        return f"{path}: {MANIFEST} has no 'files' mapping"
    if not entries:
        return f"{path}: {MANIFEST} lists no files"
    m = _STEP_DIR.match(path.name)
    if m and manifest.get("step") != int(m.group(1)):
        return f"{path}: {MANIFEST} is for step {manifest.get('step')}, not {m.group(1)}"
    for name, digest in entries:
        f = path / name
        if not f.is_file():
            return f"{path}: missing {name}"
        if _sha256(f) != digest:
            return f"{path}: checksum mismatch in {name}"
    return None


def remove_partial_saves(run_dir: Path) -> list[Path]:
    """Delete the temp dirs of saves that were killed before their rename; for the process that owns the run
    (a reader of a live run dir must not call it: the trainer may be writing one)."""
    root = run_dir / "checkpoints"
    stale = sorted(root.glob(".step-*.tmp")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt ones are named in a warning and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping corrupt checkpoint: %s", problem)
    return None


def checkpoint_to_resume(run_dir: Path, clean: bool = True, log: Callable[[str], None] = print) -> Path | None:
    """The checkpoint a resumed run (RL or SFT) starts from: the newest that verifies, once the temp dirs of
    killed saves are gone (``clean``: only the process that owns the run removes them); None, said in
    ``log``, when there is none."""
    if clean:
        remove_partial_saves(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        log(f"{run_dir}: no usable checkpoint to resume from; starting from step 0")
    return ckpt


def load_weights(model, path: Path) -> None:
    """Load weights saved by ``save_checkpoint`` into an already-built model (full or LoRA)."""
    adapter = path / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    state = {}
    for shard in sorted(path.glob("model*.safetensors")):
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})")


def load_checkpoint(path: Path, model) -> tuple[dict, dict[str, Any]]:
    """Restore weights and RNG; return (optimizer state, trainer state) for the caller to apply."""
    load_weights(model, path)
    # Onto the host: a GPU run's checkpoint then resumes anywhere (the optimizer moves its state to the params).
    set_rng_state(torch.load(path / "rng.pt", weights_only=False, map_location="cpu"))
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu")
    state = json.loads((path / "trainer_state.json").read_text())
    return optimizer_state, state
