"""What a run's processes ask of the machine or the Ray cluster, checked before anything is started.

Ray waits, without a word, for resources that never come: an actor asking for more CPUs or GPUs than the
cluster has is never placed. So the learner rank actors and rollout workers a config asks for are counted
against the cluster before anything is placed (``capacity_problem``); for a local Ray, against this machine
before Ray is even started (``local_placement_problem``, run by ``polyrl train`` right after the config loads).
Only what certainly cannot be placed is refused: more processes than cores is legal (slower, not stuck), and
so is a CPU count a user gives Ray above the machine's. Memory is checked the same way (``memory_problem``): the
least the learner ranks and rollout workers must hold (the weights, and for a full fine-tune their gradients
and Adam's two moments) against the memory free on this machine, before any model loads, so that a run asked
of too small a machine ends in one line instead of an out-of-memory kill halfway through its first step.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from polyrl.config import engines_of
from polyrl.models.device import wants_gpu
from polyrl.models.loading import SMOLLM2_ALIAS, TINY_ALIAS, ModelNotFoundError, cache_dir, resolve_model_path
from polyrl.waits import WaitTimeoutError

CONNECT_TIMEOUT_S = 10.0
"""How long ``runtime.ray_address`` may take to accept a connection before the run says so (ray.init would
retry for minutes)."""


class PlacementError(RuntimeError):
    """The machine or the Ray cluster cannot hold what the config asks for."""


def capacity_problem(cluster: dict[str, float], ranks: int, workers: int, gpu: bool) -> str | None:
    """Why the cluster cannot hold ``ranks`` learner rank actors and ``workers`` rollout workers (one CPU each at
    least; a GPU each on cuda), or None. Checked before anything is placed: Ray would otherwise wait forever."""
    need = {"CPU": ranks + workers, **({"GPU": ranks + workers} if gpu else {})}
    for resource, count in need.items():
        have = int(cluster.get(resource, 0))
        if count > have:
            parts = ([f"{ranks} learner ranks"] if ranks else []) + ([f"{workers} rollout workers"] if workers else [])
            return (f"runtime: {' and '.join(parts)} need {count} {resource}s (one each at least), the Ray cluster "
                    f"has {have}: lower learner.world_size or runtime.num_workers, or add nodes")
    return None


def ray_actors(config: Any) -> tuple[int, int]:
    """(learner rank actors, rollout worker actors) a ``runtime.kind: ray`` run places; the driver is the one
    learner at world size 1 and needs no actor."""
    world = config.learner.world_size
    workers = config.runtime.num_workers if engines_of(config) == "disaggregated" else 0
    return (world if world > 1 else 0), workers


def local_placement_problem(config: Any, cpus: int | None = None, gpus: int | None = None) -> str | None:
    """Why a local Ray (``runtime.ray_address`` unset) on this machine cannot place the run's actors, or None.
    ``cpus`` and ``gpus`` default to what this machine has; Ray never counts more CPUs than ``os.cpu_count()``
    (it may count fewer under a cgroup quota: the check after Ray starts catches that)."""
    rt = config.runtime
    if rt.kind != "ray" or rt.ray_address:
        return None
    gpu = wants_gpu(config.train.device)
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if gpu else 0
    cluster = {"CPU": float(rt.ray_num_cpus or cpus or os.cpu_count() or 1), "GPU": float(gpus)}
    problem = capacity_problem(cluster, *ray_actors(config), gpu)
    return problem.replace("the Ray cluster has", "a local Ray on this machine has") if problem else None


def check_ray_address(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``runtime.ray_address`` (host:port, or ray://host:port) accepts a connection within ``timeout_s``;
    a one-line error otherwise. ``auto`` and unset are left to Ray."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port: Ray reads it its own way
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except TimeoutError:
        raise WaitTimeoutError(f"the Ray cluster at {address} to accept a connection", timeout_s,
                               "runtime.ray_address", "is the head node up and reachable?") from None
    except OSError as exc:
        raise PlacementError(f"runtime.ray_address: nothing answers at {address} ({exc.strerror or exc}); "
                             "start the head node (ray start --head) or fix the address") from None


FULL_FINE_TUNE_BYTES = 16
"""Bytes per parameter a full fine-tune's learner holds at least: float32 weights, gradients, Adam's two moments."""
ENGINE_BYTES = 2
"""Bytes per parameter an engine's copy of the weights holds at least (bf16)."""


def free_memory_bytes() -> int | None:
    """Memory this machine can give a new process now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def checkpoint_parameters(model_dir: Path) -> int | None:
    """The parameter count of the safetensors weights in ``model_dir``, read from the files' headers (no tensor
    is loaded), or None when there are none."""
    total = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total if files else None


def memory_need_bytes(config: Any, parameters: int) -> tuple[int, str]:
    """The least memory the run's processes hold for a model of ``parameters``, and what they are: every learner
    rank its share of the trained state (FSDP2 shards it over ``learner.world_size``) and, beside a sharded
    learner, a whole copy to sample from; every rollout worker a copy of the weights. Activations, caches and
    the framework's own memory come on top: this is a floor, not an estimate."""
    world = config.learner.world_size
    lora = config.model.lora is not None
    trained = ENGINE_BYTES * parameters if lora else FULL_FINE_TUNE_BYTES * parameters
    if world > 1:
        trained = trained // world + ENGINE_BYTES * parameters
    workers = ray_actors(config)[1] if config.runtime.kind == "ray" else 0
    need = world * trained + workers * ENGINE_BYTES * parameters
    parts = [f"{world} learner rank{'s' if world > 1 else ''} ({'LoRA' if lora else 'full fine-tune'})"]
    if workers:
        parts.append(f"{workers} rollout worker{'s' if workers > 1 else ''}")
    return need, " and ".join(parts)


def model_parameters(name: str) -> int | None:
    """The parameter count of model ``name`` from its checkpoint's headers, or None when that needs a conversion
    first (the bundled model before its first load) or the model is the tiny test one."""
    if name == TINY_ALIAS:
        return None
    try:
        model_dir = cache_dir() / SMOLLM2_ALIAS if name == SMOLLM2_ALIAS else resolve_model_path(name)
    except ModelNotFoundError:  # loading the model says so, with its own exit code
        return None
    return checkpoint_parameters(model_dir) if model_dir.is_dir() else None


def memory_problem(config: Any, parameters: int | None, free_bytes: int | None, device: str = "cpu") -> str | None:
    """Why this machine's free memory cannot hold the run's processes for a model of ``parameters``, or None
    (also when either number is unknown, or the model trains on a GPU). Only the floor of ``memory_need_bytes``
    is compared."""
    if parameters is None or free_bytes is None or device != "cpu":
        return None
    need, who = memory_need_bytes(config, parameters)
    if need <= free_bytes:
        return None
    return (f"runtime: {who} need at least {need / 1e9:.1f} GB for the {parameters / 1e6:.0f}M parameters of "
            f"{config.model.name} (weights{'' if config.model.lora else ', gradients and Adam states'}), this "
            f"machine has {free_bytes / 1e9:.1f} GB free: lower learner.world_size or runtime.num_workers, train "
            "LoRA adapters (model.lora), or free memory")
