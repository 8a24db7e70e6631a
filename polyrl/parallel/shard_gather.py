"""Whole tensors of sharded (DTensor) parameters, for the weight sync (``weight_sync.py``).

``full_tensor`` is DTensor's all-gather: every learner rank ends with the whole tensor. The weight sync needs
it on learner rank 0 only, so ``BucketGather`` has the other ranks send their shards of parameters sharded on
dim 0 of a 1-D mesh (FSDP2's layout) straight into rank 0's bucket buffer, point to point. Rank 0 receives what
it would in an all-gather, the other ranks receive nothing and build no whole tensor, and gloo's point-to-point
path is about three times faster than its all-gather here (benchmarks/weight_sync.py measures both). Other
layouts (HSDP's 2-D mesh, another shard dim) fall back to ``full_tensor``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: an all-gather among the learners for a DTensor, else itself."""
    if not isinstance(p, DTensor):
        return p.detach()
    mesh = p.device_mesh
    if p.device.type != mesh.device_type:  # FSDP2's CPU offload keeps the shards in host memory
        p = DTensor.from_local(p.to_local().to(mesh.device_type), mesh, p.placements, shape=p.shape,
                               stride=p.stride())
    return p.full_tensor().detach()


def dim0_rows(p: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each mesh rank's rows [lo, hi) when ``p`` is a DTensor sharded on dim 0 over a 1-D mesh, else None.
    Shard(0) splits as ``torch.chunk`` does: ceil(rows / ranks) each, the last ones shorter or empty."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or type(p.placements[0]) is not Shard:
        return None
    if p.placements[0].dim != 0:
        return None
    rows, ranks = p.shape[0], p.device_mesh.size()
    per = -(-rows // ranks)
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(ranks)]


class BucketGather:
    """Collects one bucket's tensors into learner rank 0's destinations; every learner rank calls ``add`` for
    the same tensors in the same order (``dest`` is None except on rank 0), then ``wait``."""

    def __init__(self, point_to_point: bool = True) -> None:
        self.point_to_point = point_to_point
        self._works: list[dist.Work] = []
        self._sending: list[torch.Tensor] = []  # alive until their sends complete

    @torch.no_grad()
    def add(self, p: torch.Tensor, dest: torch.Tensor | None, dtype: torch.dtype, tag: int) -> None:
        rows = dim0_rows(p) if self.point_to_point else None
        if rows is None:
            self.wait()  # a collective on the group the sends use: not interleaved with them
            full = full_tensor(p)
            if dest is not None:
                dest.copy_(full)
            return
        mesh, local = p.device_mesh, p.to_local()
        group, me = mesh.get_group(), mesh.get_local_rank()
        lo, hi = rows[me]
        if local.shape[0] != hi - lo:
            raise RuntimeError(f"weight sync: a shard of {tuple(local.shape)} on rank {me}, expected {hi - lo} rows")
        if me != 0:
            if hi > lo:
                send = local.to(device=mesh.device_type, dtype=dtype).contiguous()
                self._sending.append(send)
                self._works.append(dist.isend(send, group=group, group_dst=0, tag=tag))
            return
        if dest is None:
            raise RuntimeError("weight sync: learner rank 0 of the sync group must be rank 0 of the FSDP mesh")
        dest[lo:hi].copy_(local)
        for r, (lo, hi) in enumerate(rows[1:], start=1):
            if hi > lo:
                self._works.append(dist.irecv(dest[lo:hi], group=group, group_src=r, tag=tag))

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._sending.clear()
