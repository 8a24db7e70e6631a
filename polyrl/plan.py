"""The run's shape, decided once: which device, how many learner ranks and which one this process is, which
runtime, where the engines sample and how the policy's weights reach them.

``resolve_plan`` is a pure function of the config (and, for the rank, of the process group once joined); the
run loop calls it where a run starts and hands the ``RunPlan`` to what reads it (``build_run``, the learner,
the runtimes, the FSDP helpers, the collectives). Which rank this process is, torch.distributed answers once, to
``parallel/group.join_group``.
The config's own rules (``config/__init__.py``) refuse the shapes that do not exist before this runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from polyrl.config import Config, engines_of, weight_sync_of
from polyrl.models.device import resolve_device

WeightSync = Literal["in_process", "gather", "host_copy", "object_store", "collective"]
"""How each update's weights reach the engines that sample:

- in_process: the engine samples from the policy in this process (``engine.sync()`` refreshes its bf16 copy,
  or reloads vLLM's weights in place);
- gather: every learner rank all-gathers the sharded policy into its own whole engine copy, then syncs it;
- host_copy: the async runtime puts a host copy of the state dict on the rollout process's queue;
- object_store: rank 0 puts one host copy into Ray's object store for the rollout workers;
- collective: learner rank 0 broadcasts the weights to the rollout workers in buckets (``parallel/weight_sync.py``).
"""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner ranks (rank 0 of 1 without a process group)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run's files (metrics, checkpoints' manifest, summary, report)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class RunPlan:
    """What shape the run has, as ``resolve_plan`` decided it."""

    device: str
    """``train.device`` resolved: ``cpu``, or ``cuda:N`` (the GPU this process uses)."""
    world_size: int
    """Learner ranks of the run (``learner.world_size``)."""
    sharded: bool
    """This process is one of several learner ranks: its learner trains an FSDP2 shard of the policy, and its
    engine samples from a whole copy gathered after each update."""
    ranks: Ranks
    """This process's rank; ``Ranks()`` in a process outside the learners' group (one learner, the async
    rollout process, a Ray rollout worker)."""
    runtime: Literal["local", "async", "ray"]
    engine: Literal["hf", "vllm"]
    engines: Literal["colocated", "disaggregated"]
    """colocated: rollouts run on the learner's devices; disaggregated: on Ray rollout workers."""
    rollout_workers: int
    """Processes beside the learner ranks that roll out: the async rollout process, or the Ray workers."""
    weight_sync: WeightSync

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def disaggregated(self) -> bool:
        return self.engines == "disaggregated"


def resolve_plan(config: Config, ranks: Ranks = Ranks()) -> RunPlan:
    """The plan of ``config`` for a process at ``ranks`` (``join_group``'s answer under several learner ranks).
    Resolve it after joining: on a GPU the joined rank's device is the one ``train.device`` resolves to."""
    rt, world = config.runtime, config.learner.world_size
    engines = engines_of(config)
    if engines == "disaggregated":
        sync = weight_sync_of(config)
        workers = rt.num_workers
    else:  # runtime.weight_sync only concerns disaggregated workers (the config refuses collective here)
        sync = "host_copy" if rt.kind == "async" else "gather" if world > 1 else "in_process"
        workers = 1 if rt.kind == "async" else 0
    return RunPlan(device=str(resolve_device(config.train.device)), world_size=world, sharded=ranks.distributed,
                   ranks=ranks, runtime=rt.kind, engine=config.engine.kind, engines=engines,
                   rollout_workers=workers, weight_sync=sync)
