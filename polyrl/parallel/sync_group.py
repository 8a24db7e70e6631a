"""The process group of a weight sync: learner rank 0 (sync rank 0) and the engines (sync ranks 1..E), on a TCP
store hosted by learner rank 0, apart from the learners' own training group (``weight_sync.py`` sends over it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist


@dataclass
class SyncGroup:
    """Learner rank 0 (sync rank 0) and the engines (sync ranks 1..E) in one process group.

    ``pg`` is None on learner ranks > 0: they take part in each sync's gathers, which run on the learners'
    own group, but send nothing. Collectives use the low-level ``ProcessGroup`` calls, so the group does not
    have to be torch's default group (``dist.new_group`` of a larger world works too: pass it as ``pg``).
    """

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    device: torch.device
    timeout: timedelta
    store: Any = field(default=None, repr=False)  # kept alive for the group's lifetime

    @property
    def member(self) -> bool:
        return self.pg is not None

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> dist.Work:
        """Start a broadcast from sync rank 0; the caller waits on the returned work."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout_s is not None:
            opts.timeout = timedelta(seconds=timeout_s)
        return self.pg.broadcast([tensor], opts)

    def all_min(self, value: int) -> int:
        """The minimum of ``value`` over all members (the acknowledgement of a sync)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def all_texts(self, text: str, nbytes: int = 2048) -> list[str]:
        """Every member's ``text`` (cut to ``nbytes``), in sync-rank order: an engine's error for the learner."""
        mine = torch.zeros(nbytes, dtype=torch.uint8)
        raw = text.encode()[:nbytes]
        mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        out = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.pg.allgather([out], [mine.to(self.device)]).wait()
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in out]

    def close(self) -> None:
        if self.store is not None and hasattr(self.pg, "shutdown"):  # a group of torch's world is torch's to end
            self.pg.shutdown()
        self.pg, self.store = None, None


def join_sync_group(
    role: Literal["learner", "engine"],
    rank: int,
    num_engines: int,
    host: str,
    port: int,
    backend: Literal["gloo", "nccl"] = "gloo",
    timeout_s: float = 600.0,
    device: torch.device | None = None,
    join_timeout_s: float | None = None,
) -> SyncGroup:
    """Join the sync group on a TCP store at ``host:port`` (hosted by learner rank 0). ``rank`` is the learner
    rank or the engine index. Learner ranks > 0 return a non-member handle at once; the others block until all
    1 + ``num_engines`` members have joined, or raise after ``join_timeout_s`` (default ``timeout_s``: engines
    may take longer to start than a collective should take). ``timeout_s`` bounds every collective."""
    timeout = timedelta(seconds=timeout_s)
    join_timeout = timedelta(seconds=join_timeout_s or timeout_s)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if role == "learner" and rank > 0:
        return SyncGroup(None, -1, 1 + num_engines, device, timeout)
    sync_rank = 0 if role == "learner" else 1 + rank
    size = 1 + num_engines
    store = dist.TCPStore(host, port, size, is_master=sync_rank == 0, timeout=join_timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("polyrl_weight_sync", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(prefixed, sync_rank, size, opts)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, sync_rank, size, opts)
    else:
        raise ValueError(f"weight sync backend {backend!r}: expected gloo or nccl")
    return SyncGroup(pg, sync_rank, size, device, timeout, store)
