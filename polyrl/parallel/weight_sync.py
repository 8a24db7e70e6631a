"""Weight sync from data-parallel learner ranks to engine processes that are not learner ranks.

Learner rank 0 and the engines (disaggregated sampling processes, Ray rollout workers) form a process group of
their own (gloo on CPU, NCCL on GPU), apart from the learners' training group. Each sync: rank 0 broadcasts a
header (version; all parameters or adapters only; each bucket's names, dtypes, shapes, offsets); then for each
bucket of at most ``bucket_mb`` MB the learner ranks make its whole tensors on rank 0 (FSDP2's shards sent to
rank 0 into the bucket's buffer, ``shard_gather.py``; or ``full_tensor()``, an all-gather) and rank 0 broadcasts
the buffer (one collective per bucket, the next bucket gathered while one is on the wire); each engine copies
the tensors into its model by name and calls ``engine.sync()``; last, an all-reduce acknowledges: an engine that
could not apply the sync (a name it lacks, a parameter not sent, such as a LoRA adapter) makes both sides
raise, with its reason.

No process holds more than two buckets of full tensors besides its own model (a tensor larger than a bucket
travels alone), so no process needs a full copy of the policy. Every collective has the group's timeout: a dead
or stalled peer is an error on the other side, not a hang; the group is then unusable (join a new one).

On every learner rank (the same ``version`` everywhere; ``policy`` the model itself, not a wrapper around it)::

    group = join_sync_group("learner", rank, num_engines, host, port)   # rank 0 hosts the store
    sender = WeightSender(policy, group, bucket_mb=256)
    metrics = sender.send(version)                                       # after each update

and on engine ``index`` (0..E-1)::

    group = join_sync_group("engine", index, num_engines, host, port)
    receiver = WeightReceiver(group, engine)                             # engine.policy gets the weights
    metrics = receiver.receive()                                         # when a sync is due; None once closed

1 MB is 10**6 bytes here (buckets and MB/s alike).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from polyrl.parallel.shard_gather import BucketGather, full_tensor
from polyrl.parallel.sync_group import SyncGroup

MB = 1_000_000
_ALIGN = 64  # byte offsets of tensors in a bucket, so that a slice can be viewed as any dtype
_STOP = -1  # the version sent by WeightSender.close(): no more syncs
_FAILED = -2  # an engine's acknowledgement when it could not apply a sync
# Wrapper modules that insert a path segment into parameter names (FSDP1, activation checkpointing,
# torch.compile) or a prefix (DDP); FSDP2 keeps the plain names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
_PEFT_PREFIX = "base_model.model."
Entry = tuple[str, str, list[int], int, int]
"""One tensor of a bucket: (name, dtype, shape, byte offset, bytes); shapes are whole (DTensor) shapes."""


class EngineLostError(RuntimeError):
    """A sync's broadcast failed: an engine of the group is gone or stalled; the group is unusable."""


class SupportsSync(Protocol):
    policy: torch.nn.Module

    def sync(self) -> None: ...


def canonical_name(name: str) -> str:
    """A parameter name with wrapper segments and DDP's ``module.`` prefix removed."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def plain_name(name: str) -> str:
    """The name of a parameter in the model without peft: no ``base_model.model.`` prefix, no ``.base_layer``
    (peft's LoRA layer keeps the original weight under it)."""
    name = canonical_name(name)
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_buckets(
    items: list[tuple[str, torch.Tensor]], bucket_bytes: int, wire_dtype: torch.dtype | None = None
) -> list[list[Entry]]:
    """Group ``(name, tensor)`` into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its
    own), in order."""
    buckets: list[list[Entry]] = [[]]
    used = 0
    for name, t in items:
        dtype = wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * dtype.itemsize
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((name, str(dtype).removeprefix("torch."), list(t.shape), used, nbytes))
        used = _aligned(used + nbytes)
    return [b for b in buckets if b]


def _bucket_size(bucket: list[Entry]) -> int:
    return _aligned(bucket[-1][3] + bucket[-1][4])


def _view(buf: torch.Tensor, dtype: str, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
    return buf[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)


class WeightSender:
    """The learner side; every learner rank makes one and calls ``send`` with the same version.

    ``adapter_only``: send only the trainable parameters (LoRA adapters); None means yes for a peft model.
    ``wire_dtype`` (e.g. bfloat16) casts floating-point tensors for the wire; None sends them exactly.
    ``point_to_point``: shards go to rank 0 by sends (``shard_gather.BucketGather``); False: ``full_tensor()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        group: SyncGroup,
        bucket_mb: float = 256.0,
        adapter_only: bool | None = None,
        wire_dtype: torch.dtype | None = None,
        point_to_point: bool = True,
    ) -> None:
        self.model, self.group, self.point_to_point = model, group, point_to_point
        self.bucket_bytes = int(bucket_mb * MB)
        self.adapter_only = hasattr(model, "peft_config") if adapter_only is None else adapter_only
        self.wire_dtype = wire_dtype
        self._buffers: list[torch.Tensor] = []  # two, for the bucket on the wire and the one being packed

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        # Read at each sync: FSDP2 swaps sharded and unsharded parameters around forward and backward.
        items = [(canonical_name(n), p) for n, p in self.model.named_parameters()]
        if self.adapter_only:
            items = [(n, p) for n, p in items if p.requires_grad]
            if not items:
                raise RuntimeError("weight sync: adapter-only sync but the model has no trainable parameters")
        return items

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        self._buffers += [torch.empty(0, dtype=torch.uint8)] * (slot + 1 - len(self._buffers))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot][:nbytes]

    @torch.no_grad()
    def send(self, version: int) -> dict[str, float]:
        """One sync of the current weights, tagged ``version`` (>= 0). Returns ``sync/*`` metrics on rank 0
        (time, bytes, MB/s, buckets); an empty dict on the other learner ranks."""
        if version < 0:
            raise ValueError(f"weight sync: version must be >= 0, got {version}")
        t0 = time.perf_counter()
        items = self._params()
        buckets = plan_buckets(items, self.bucket_bytes, self.wire_dtype)
        params = dict(items)
        g = self.group
        # A broadcast that fails (an engine lost) stops the broadcasts but not the gathers, so that the other
        # learner ranks, which only gather, finish the sync in step with rank 0; rank 0 then raises.
        lost: list[str] = []

        def on_wire(call):
            if lost:
                return None
            try:
                return call()
            except Exception as exc:  # gloo/NCCL errors have no common type
                lost.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
                return None

        if g.member:
            header = json.dumps({"mode": "adapter" if self.adapter_only else "all", "buckets": buckets}).encode()
            meta = torch.tensor([version, len(header), len(buckets)], dtype=torch.int64, device=g.device)
            on_wire(lambda: g.broadcast(meta).wait())
            head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(g.device)
            on_wire(lambda: g.broadcast(head).wait())
        pending: list[dist.Work | None] = [None, None]
        gather_s = 0.0
        for k, bucket in enumerate(buckets):
            slot = k % 2
            if pending[slot] is not None:  # the buffer is reused once its broadcast two buckets ago is done
                on_wire(pending[slot].wait)
                pending[slot] = None
            buf = self._buffer(slot, _bucket_size(bucket)) if g.member else None
            tg = time.perf_counter()
            gather = BucketGather(self.point_to_point)  # collectives: every learner rank, in the same order
            for i, (name, dtype, shape, offset, nbytes) in enumerate(bucket):
                dest = _view(buf, dtype, shape, offset, nbytes) if buf is not None else None
                gather.add(params[name], dest, getattr(torch, dtype), tag=i)
            gather.wait()
            gather_s += time.perf_counter() - tg
            if buf is not None:
                pending[slot] = on_wire(lambda b=buf: g.broadcast(b))
        for work in pending:
            if work is not None:
                on_wire(work.wait)
        self._buffers.clear()  # two buckets' worth of (GPU) memory, not kept through training
        if not g.member:
            return {}
        if lost:
            raise EngineLostError(f"weight sync: version {version} did not reach the engines: {lost[0]}")
        if g.all_min(version) != version:
            errors = [f"engine {i - 1}: {e}" for i, e in enumerate(g.all_texts("")) if e]
            raise RuntimeError(f"weight sync: version {version} was not applied: " + " | ".join(errors))
        seconds = time.perf_counter() - t0
        nbytes = sum(e[4] for b in buckets for e in b)
        return {"sync/time_s": seconds, "sync/bytes": float(nbytes), "sync/mb_per_s": nbytes / MB / seconds,
                "sync/buckets": float(len(buckets)), "sync/gather_s": gather_s, "sync/version": float(version)}

    def close(self) -> None:
        """Tell the engines that no more syncs come (their ``receive`` returns None), then leave the group."""
        g = self.group
        if g.member:
            g.broadcast(torch.tensor([_STOP, 0, 0], dtype=torch.int64, device=g.device)).wait()
        g.close()


def _index(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Engine parameters by canonical name, plus their peft-free names where those are unambiguous (a plain
    learner can then fill a peft engine's base weights)."""
    index = {canonical_name(n): p for n, p in model.named_parameters()}
    aliases: dict[str, list[torch.nn.Parameter]] = {}
    for n, p in index.items():
        aliases.setdefault(plain_name(n), []).append(p)
    for n, ps in aliases.items():
        if n not in index and len(ps) == 1:
            index[n] = ps[0]
    return index


class WeightReceiver:
    """The engine side: receives each sync into ``model`` (default ``engine.policy``), then ``engine.sync()``."""

    def __init__(
        self, group: SyncGroup, engine: SupportsSync | None = None, model: torch.nn.Module | None = None
    ) -> None:
        if model is None and engine is None:
            raise ValueError("WeightReceiver needs an engine or a model")
        self.group, self.engine = group, engine
        self.model = model if model is not None else engine.policy
        self.version = -1
        self._by_name = _index(self.model)
        self._names = {canonical_name(n) for n, _ in self.model.named_parameters()}
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=group.device)] * 2

    def _recv(self, slot: int, nbytes: int) -> tuple[torch.Tensor, dist.Work]:
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        buf = self._buffers[slot][:nbytes]
        return buf, self.group.broadcast(buf)

    def _resolve(self, mode: str, buckets: list) -> tuple[list[list[torch.Tensor | None]], list[str]]:
        """The engine parameter for each header entry, and the problems (missing, mismatched, not covered)."""
        problems, covered, targets = [], set(), []
        for bucket in buckets:
            row = []
            for name, _, shape, _, _ in bucket:
                p = self._by_name.get(name, self._by_name.get(plain_name(name)))
                if p is None:
                    problems.append(f"the engine model has no parameter {name!r}")
                elif list(p.shape) != shape:
                    problems.append(f"{name!r}: shape {shape} sent, {list(p.shape)} in the engine model")
                    p = None
                row.append(p)
                if p is not None:
                    covered.add(id(p))
            targets.append(row)
        expected = [n for n in self._names if mode == "all" or ".lora_" in n]
        missed = sorted(n for n in expected if id(self._by_name[n]) not in covered)
        problems += [f"{n!r} was not sent ({mode} sync)" for n in missed]
        if mode == "adapter" and not expected:
            problems.append("adapter-only sync but the engine model has no LoRA adapters (it must be a peft "
                            "model with the learner's adapter names)")
        return targets, problems

    @torch.no_grad()
    def receive(self, wait_s: float | None = None) -> dict[str, float] | None:
        """Receive one sync (blocking until learner rank 0 sends it, at most ``wait_s``, default the group's
        timeout), apply it and call ``engine.sync()``. Returns ``sync/*`` metrics, or None once the sender has
        closed. Raises if the sync could not be applied, after telling the learner."""
        g = self.group
        meta = torch.zeros(3, dtype=torch.int64, device=g.device)
        g.broadcast(meta, timeout_s=wait_s).wait()
        t0 = time.perf_counter()
        version, header_len, _ = (int(v) for v in meta.tolist())
        if version == _STOP:
            g.close()
            return None
        raw = torch.empty(header_len, dtype=torch.uint8, device=g.device)
        g.broadcast(raw).wait()
        header = json.loads(bytes(raw.cpu().tolist()))
        buckets = header["buckets"]
        targets, problems = self._resolve(header["mode"], buckets)
        if problems:  # the model keeps its previous weights rather than a mix; the buckets are still drained
            targets = [[None] * len(b) for b in buckets]
        # One bucket on the wire while the one before it is copied into the model.
        inflight = self._recv(0, _bucket_size(buckets[0])) if buckets else None
        for k, bucket in enumerate(buckets):
            buf, work = inflight
            work.wait()
            if k + 1 < len(buckets):
                inflight = self._recv((k + 1) % 2, _bucket_size(buckets[k + 1]))
            for (_, dtype, shape, offset, nbytes), p in zip(bucket, targets[k], strict=True):
                if p is not None:
                    p.copy_(_view(buf, dtype, shape, offset, nbytes))
        copy_s = time.perf_counter() - t0
        ok = not problems
        if ok and self.engine is not None:
            try:
                self.engine.sync()
            except Exception as exc:  # the learner must hear of it before this process raises
                problems.append(f"engine.sync() failed: {type(exc).__name__}: {exc}")
                ok = False
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        if g.all_min(version if ok else _FAILED) != version:  # every member then shares its error
            g.all_texts(shown)
        if problems:
            raise RuntimeError(f"weight sync version {version}: {shown}")
        self.version = version
        seconds = time.perf_counter() - t0
        nbytes = sum(e[4] for b in buckets for e in b)
        return {"sync/time_s": seconds, "sync/bytes": float(nbytes), "sync/mb_per_s": nbytes / MB / seconds,
                "sync/apply_s": seconds - copy_s, "sync/version": float(version)}


def iter_full_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical name, full tensor)`` of every parameter (a collective on every learner rank): what the
    engines hold after a full sync; used by tests and the benchmark."""
    for n, p in model.named_parameters():
        yield canonical_name(n), full_tensor(p)
