"""Sharded checkpoints for the data-parallel learner: each rank writes its own shards with
``torch.distributed.checkpoint`` (DCP), atomically like ``polyrl/checkpoint/store.py`` (temp dir, fsync, rename,
a manifest of sha256 checksums), so ``latest_checkpoint`` / ``verify_checkpoint`` apply to both kinds.

Layout of ``step-N/``::

    dcp/.metadata, dcp/__<rank>_0.distcp   model (trainable parameters) and optimizer, by fully-qualified name
    rng/rank-<r>.pt                        each rank's RNG states
    trainer_state.json                     the caller's ``extra`` dict, from rank 0
    hf/config.json, hf/tokenizer*, hf/adapter_config.json (LoRA)   what an HF export needs besides weights
    sharded.json                           format, world size, base model, LoRA or not
    manifest.json                          written last, by rank 0: step and every file's checksum

The same calls work for an FSDP2-sharded model under a process group and for a plain model in one process
without one; DCP reshards on load, so a checkpoint saved at one world size loads at another. Frozen
parameters (a LoRA base) are not saved: they come from the base model, as in today's adapter checkpoints.
All ranks must see one filesystem (DCP's own assumption: rank 0 writes the metadata of every rank's shards).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from polyrl.checkpoint import faults
from polyrl.checkpoint.store import MANIFEST, _fsync_dir, _sha256, rng_state, set_rng_state

log = logging.getLogger(__name__)

FORMAT = "polyrl-dcp/1"
META = "sharded.json"
DCP_DIR = "dcp"
RNG_DIR = "rng"
HF_DIR = "hf"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Frozen parameters are rebuilt from the base model; strict=False because they are then absent from what we load
# (dcp.load already fails on any requested key the checkpoint lacks).
_SAVE_OPTS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process whenever no group exists; that is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded(path: Path) -> bool:
    """True for a checkpoint written by ``save_sharded`` (the loop picks the loader by this)."""
    return (Path(path) / META).is_file()


def find_policy(model: torch.nn.Module) -> tuple[str, torch.nn.Module, Any | None] | None:
    """(name prefix, HF model, peft adapter config or None) of the policy inside ``model``: the model itself, or
    the shallowest Hugging Face / peft model under a wrapper (the learner's FSDP root holds the policy and the
    critic); None for a module holding none (it saves and loads, but cannot be exported). FSDP2 keeps classes
    and names, so this sees through sharding."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    for name, module in model.named_modules():  # pre-order: the shallowest match comes first
        if isinstance(module, PeftModel):
            return (f"{name}." if name else ""), module.get_base_model(), module.peft_config[module.active_adapter]
        if isinstance(module, PreTrainedModel):
            return (f"{name}." if name else ""), module, None
    return None


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP state dict: ``model`` (and ``optim``) keyed by the module's own parameter names. A tied
    parameter (the output head sharing the embedding) is kept under its first name only: it is one tensor,
    and loading that name restores both."""
    if optimizer is None:
        msd, state = get_model_state_dict(model, options=_SAVE_OPTS), {}
    else:
        msd, osd = get_state_dict(model, optimizer, options=_SAVE_OPTS)
        state = {"optim": osd}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {"model": {k: v for k, v in msd.items() if k not in aliases}, **state}


def _step_of(path: Path, extra: dict) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else int(extra.get("step", 0))


def _write_rank0_files(tmp: Path, policy, tokenizer, extra: dict, world: int, with_optimizer: bool) -> None:
    prefix, hf_model, adapter = policy or (None, None, None)
    hf = tmp / HF_DIR
    hf.mkdir()
    base = None
    if hf_model is not None:
        hf_model.config.save_pretrained(hf)
        # peft records the base's name only for a base from from_pretrained; load_model puts aliases in the config.
        base = (adapter is not None and adapter.base_model_name_or_path) or hf_model.config._name_or_path or None
    if adapter is not None:
        adapter = copy.copy(adapter)
        adapter.base_model_name_or_path = base
        adapter.save_pretrained(hf)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf)
    meta = {"format": FORMAT, "world_size": world, "base_model": base, "peft": adapter is not None,
            "policy_prefix": prefix, "optimizer": with_optimizer}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    (tmp / TRAINER_STATE).write_text(json.dumps(extra, indent=2))


def _hash_and_sync(tmp: Path, files: list[Path]) -> dict[str, str]:
    digests = {}
    for p in files:
        digests[str(p.relative_to(tmp))] = _sha256(p)
        with open(p, "rb") as f:  # fsync flushes the file's pages whichever process wrote them
            os.fsync(f.fileno())
    return digests


def save_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict,
    *,
    tokenizer: Any = None,
    keep: int | None = None,
) -> None:
    """Write a checkpoint at ``path`` (``.../step-N``) from every rank of the default group, or from one process
    without a group. Collective: every rank calls it with its own shard of ``model`` and ``optimizer``.

    Written to ``.step-N.tmp`` first; when every rank's files are on disk, the ranks checksum and fsync a share
    each, rank 0 writes the manifest and renames. A kill at any point leaves the previous checkpoint as the
    newest valid one (``latest_checkpoint``). ``extra`` (JSON) and ``tokenizer`` come from rank 0; ``keep``
    prunes all but the newest ``keep`` ``step-*`` siblings after the rename.
    """
    path = Path(path)
    rank, world = _rank_world()
    step = _step_of(path, extra)
    policy = find_policy(model)  # before any collective: an error here is every rank's, not a hang
    tmp = path.parent / f".{path.name}.tmp"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier: start clean
        (tmp / RNG_DIR).mkdir(parents=True)
    _barrier()  # nobody writes into the temp dir before it is fresh
    # An optimizer that has not stepped has no state; DCP's helper would create it by a zero step (AdamW's
    # step count then reads 1), so such a checkpoint holds the model only and a resume keeps a fresh optimizer.
    with_optimizer = optimizer is not None and bool(optimizer.state)
    state = _state(model, optimizer if with_optimizer else None)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=tmp / DCP_DIR)
    torch.save(rng_state(), tmp / RNG_DIR / f"rank-{rank}.pt")
    if rank == 0:
        _write_rank0_files(tmp, policy, tokenizer, extra, world, with_optimizer)
    _barrier()  # every rank's files exist
    faults.point("ckpt_files", step)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    mine = _hash_and_sync(tmp, files[rank::world])  # checksumming is the slow part: each rank takes a share
    if world > 1:
        shares: list[dict[str, str] | None] = [None] * world
        dist.all_gather_object(shares, mine)
        digests = {k: v for share in shares for k, v in (share or {}).items()}
    else:
        digests = mine
    if rank == 0:
        _commit(tmp, path, step, digests, keep)
    _barrier()  # no rank returns before the checkpoint is in place


def _commit(tmp: Path, final: Path, step: int, digests: dict[str, str], keep: int | None) -> None:
    manifest = {"step": step, "format": FORMAT, "files": dict(sorted(digests.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    with open(tmp / MANIFEST, "rb") as f:
        os.fsync(f.fileno())
    for d in sorted({tmp, *(p for p in tmp.rglob("*") if p.is_dir())}, reverse=True):
        _fsync_dir(d)
    faults.point("ckpt_manifest", step)
    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    faults.point("ckpt_renamed", step)
    if keep is not None:
        found = sorted((int(m.group(1)), p) for p in final.parent.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, old in found[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a ``save_sharded`` checkpoint into ``model`` (and ``optimizer``) at this world size, sharded or not;
    restore this rank's RNG states; return the trainer state (``extra``). Collective under a process group.

    Pick ``path`` with ``latest_checkpoint``, which verifies checksums. A rank the checkpoint has no RNG file
    for (resuming at a larger world size) keeps its current RNG states. A checkpoint saved before the optimizer
    first stepped leaves ``optimizer`` as it is.
    """
    path = Path(path)
    if not is_sharded(path):
        raise ValueError(f"{path}: not a sharded checkpoint (no {META}); checkpoint/store.load_checkpoint reads it")
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, this code reads {FORMAT}")
    if optimizer is not None and not meta.get("optimizer", True):
        optimizer = None
    state = _state(model, optimizer)
    if optimizer is not None and not state["optim"]["state"]:
        # DCP's helper creates the state by a zero step only when no gradient is set: loading would drop moments.
        raise ValueError(f"{path}: load before the first backward pass (the optimizer has no state to load into)")
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path / DCP_DIR)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_LOAD_OPTS)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_LOAD_OPTS)
    rank, _ = _rank_world()
    rng = path / RNG_DIR / f"rank-{rank}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    else:
        log.info("%s: no RNG state for rank %d (saved at world size %s); keeping this rank's", path, rank,
                 meta.get("world_size"))
    return json.loads((path / TRAINER_STATE).read_text())


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's saved model tensors as full, plain tensors in this process (no process group needed),
    keyed by the model's parameter names."""
    reader = dcp.FileSystemReader(str(Path(path) / DCP_DIR))
    entries = reader.read_metadata().state_dict_metadata
    tensors = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in entries.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    wanted = {"model": dict(tensors)}
    with _quiet_single_process():
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return wanted["model"]
