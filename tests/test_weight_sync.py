"""Weight sync from FSDP2 learner ranks to an engine process that is not a learner rank (parallel/weight_sync.py).

One spawn of 2 learner ranks (FSDP2 over gloo) and 1 engine process checks, for a full model and for LoRA
(adapter-only): the engine ends with exactly the learner's gathered weights, its greedy tokens change and equal
those of an engine built from the learner's weights, and a LoRA sync into an engine without adapters fails
on both sides. A second spawn of peers that die or stall checks that the other side raises within the timeout.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from polyrl.parallel.launch import free_port
from polyrl.parallel.sync_group import SyncGroup, join_sync_group
from polyrl.parallel.weight_sync import WeightReceiver, WeightSender, canonical_name, iter_full_state

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

PROMPT = [5, 17, 42, 99, 7, 3]
TOKENIZER = SimpleNamespace(pad_token_id=2, eos_token_id=2)  # all HFEngine reads from a tokenizer


def _model(lora: bool):
    from polyrl.models.loading import tiny_random_model

    model = tiny_random_model(seed=0, vocab_size=512)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
        with torch.random.fork_rng():
            # The adapters' random start seeded: from this one, three steps change the greedy answer to 77.
            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    return model


def _engine(model):
    from polyrl.engines.hf import HFEngine

    # The fused bf16 decode path: its own weight copy, stale unless engine.sync() runs after a sync.
    return HFEngine(model, TOKENIZER, bf16_weights=True, fast_decode=True, native_kernels=False)


def _greedy(engine) -> list[int]:
    return engine.generate([PROMPT], n=1, max_new_tokens=12, temperature=0.0)[0][0].token_ids


def _shard_and_step(model) -> None:
    """FSDP2 over the learner ranks (each decoder layer, then the root), then three large AdamW steps towards
    answering token 77: the greedy answer changes (one step is too little for the adapters)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = torch.tensor([PROMPT + [77] * 8])
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _learner(rank: int, ports: dict, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['learners']}", rank=rank, world_size=2)
    group = join_sync_group("learner", rank, 1, "127.0.0.1", ports["sync"], timeout_s=60)
    results = {}
    for kind in ("full", "lora"):
        model = _model(kind == "lora")
        _shard_and_step(model)
        # 4 kB buckets: many, two in flight; shards sent to rank 0 (full) or all-gathered by full_tensor (lora).
        sender = WeightSender(model, group, bucket_mb=0.004, point_to_point=kind == "full")
        metrics = sender.send(version=1 if kind == "full" else 2)
        sent = {n: t.clone() for n, t in iter_full_state(model)}
        trainable = {canonical_name(n) for n, p in model.named_parameters() if p.requires_grad}
        results[kind] = {"metrics": metrics, "state": sent, "trainable": trainable}
    try:  # the LoRA sync again, into an engine model without adapters
        sender.send(version=3)
        results["mismatch"] = "no error"
    except RuntimeError as exc:
        results["mismatch"] = str(exc)
    sender.close()
    if rank == 0:
        torch.save(results, out / "learner.pt")
    dist.destroy_process_group()


def _engine_proc(ports: dict, out: Path) -> None:
    group = join_sync_group("engine", 0, 1, "127.0.0.1", ports["sync"], timeout_s=60)
    results = {}
    for kind in ("full", "lora"):
        engine = _engine(_model(kind == "lora"))
        before = _greedy(engine)
        metrics = WeightReceiver(group, engine).receive()
        state = {canonical_name(n): p.detach().clone() for n, p in engine.policy.named_parameters()}
        results[kind] = {"metrics": metrics, "state": state, "before": before, "after": _greedy(engine)}
    plain = WeightReceiver(group, model=_model(lora=False))
    try:
        plain.receive()
        results["mismatch"] = "no error"
    except RuntimeError as exc:
        results["mismatch"] = str(exc)
    results["closed"] = plain.receive() is None
    torch.save(results, out / "engine.pt")


def _main(i: int, ports: dict, out: str) -> None:
    torch.set_num_threads(1)
    if i < 2:
        _learner(i, ports, Path(out))
    else:
        _engine_proc(ports, Path(out))


def test_fsdp_learners_to_engine_full_and_lora(tmp_path: Path) -> None:
    ports = {"learners": free_port(), "sync": free_port()}
    mp.start_processes(_main, args=(ports, str(tmp_path)), nprocs=3, start_method="forkserver")
    learner, engine = torch.load(tmp_path / "learner.pt"), torch.load(tmp_path / "engine.pt")
    for kind in ("full", "lora"):
        sent, got = learner[kind]["state"], engine[kind]["state"]
        names = learner[kind]["trainable"] if kind == "lora" else set(sent)
        assert names and names <= set(got)
        for n in names:
            assert torch.equal(sent[n], got[n]), f"{kind}: {n} differs"
        e = engine[kind]
        assert e["after"] != e["before"], f"{kind}: the engine's greedy tokens did not change"
        reference = _model(kind == "lora")
        reference.load_state_dict({k: v for k, v in sent.items()}, strict=False)
        assert e["after"] == _greedy(_engine(reference)), f"{kind}: tokens differ from the learner's weights'"
        m = learner[kind]["metrics"]
        assert m["sync/bytes"] == sum(sent[n].numel() * 4 for n in names)
        assert m["sync/buckets"] > 1 and m["sync/mb_per_s"] > 0 and m["sync/time_s"] > 0
        assert e["metrics"]["sync/version"] == m["sync/version"] == (1 if kind == "full" else 2)
    lora_bytes, full_bytes = learner["lora"]["metrics"]["sync/bytes"], learner["full"]["metrics"]["sync/bytes"]
    assert lora_bytes < 0.1 * full_bytes  # adapter-only: the frozen base is not sent
    assert all(".lora_" in n for n in learner["lora"]["trainable"])
    assert "version 3 was not applied" in learner["mismatch"] and "lora_A" in learner["mismatch"]
    assert "no parameter" in engine["mismatch"] and "lora_A" in engine["mismatch"]
    assert engine["closed"]


def _world_main(rank: int, port: int, out: str) -> None:
    """Ranks 0-1 learners (FSDP2 on their own subgroup), rank 2 an engine; the sync group a subgroup {0, 2}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    learners, sync = dist.new_group([0, 1]), dist.new_group([0, 2])  # every rank creates every group
    torch.manual_seed(0)
    # Uneven shards: 63 rows split 32 + 31, one row split 1 + 0.
    model = torch.nn.Sequential(torch.nn.Linear(64, 63), torch.nn.Linear(63, 1))
    timeout = timedelta(seconds=30)
    if rank < 2:
        fully_shard(model, mesh=DeviceMesh.from_group(learners, "cpu"))
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(1.0 + rank)  # each rank's shard changed differently
        group = SyncGroup(sync if rank == 0 else None, 0 if rank == 0 else -1, 2, torch.device("cpu"), timeout)
        WeightSender(model, group, bucket_mb=0.01).send(5)
        state = dict(iter_full_state(model))
    else:
        receiver = WeightReceiver(SyncGroup(sync, 1, 2, torch.device("cpu"), timeout), model=model)
        receiver.receive()
        state = {canonical_name(n): p.detach() for n, p in model.named_parameters()}
    if rank != 1:
        torch.save(state, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_sync_group_as_a_subgroup_of_a_larger_world(tmp_path: Path) -> None:
    mp.start_processes(_world_main, args=(free_port(), str(tmp_path)), nprocs=3, start_method="forkserver")
    sent, got = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank2.pt")
    assert set(sent) == set(got) and all(torch.equal(sent[n], got[n]) for n in sent)


# -- dead and stalled peers -------------------------------------------------------------------------------------

TIMEOUT_S = 3.0
STALL_WAIT_S = 1.0  # a receive's own limit: the learner_stalls case must raise by it, before TIMEOUT_S


def _record(out: Path, scenario: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
        result = "no error"
    except Exception:
        result = traceback.format_exc()
    (out / f"{scenario}.txt").write_text(f"{time.perf_counter() - t0:.2f}\n{result}")


def _wait_for(path: Path) -> None:
    deadline = time.time() + 3 * TIMEOUT_S
    while not path.exists() and time.time() < deadline:
        time.sleep(0.1)


def _fault_main(i: int, ports: list[int], out_dir: str) -> None:
    """Processes 0 and 1 are a pair, 2 and 3 another, each pair joined in two sync groups: the odd process is
    the engine of its pair's first group and the learner of the second, and dies (1) or stalls (3) once joined;
    the even one is the other side of both and records what each side sees."""
    torch.set_num_threads(1)
    out, kind, faulty = Path(out_dir), ("dies", "stalls")[i // 2], i % 2 == 1
    first, second = ports[2 * (i // 2) : 2 * (i // 2) + 2]
    # 4 processes start on 2 cores: joining may take longer than the collectives' timeout.
    kw = {"timeout_s": TIMEOUT_S, "join_timeout_s": 120.0}
    g1 = join_sync_group("engine" if faulty else "learner", 0, 1, "127.0.0.1", first, **kw)
    g2 = join_sync_group("learner" if faulty else "engine", 0, 1, "127.0.0.1", second, **kw)
    if faulty:
        # Dies once the other side has joined (the store it rendezvoused on lives here), or stalls: alive, in
        # both groups, but never taking part, until the other side is done.
        _wait_for(out / (f"joined_{kind}" if kind == "dies" else f"learner_{kind}.txt"))
        os._exit(0)
    (out / f"joined_{kind}").touch()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    time.sleep(1.0)  # the dying peer has exited by now
    _record(out, f"engine_{kind}", lambda: WeightSender(model, g1, bucket_mb=0.1).send(1))
    # Waiting for a sync may have its own, shorter limit than the group's timeout.
    wait_s = STALL_WAIT_S if kind == "stalls" else None
    _record(out, f"learner_{kind}", lambda: WeightReceiver(g2, model=model).receive(wait_s=wait_s))
    os._exit(0)  # the groups' threads would wait for the dead peer at interpreter exit


def test_dead_or_stalled_peer_raises_within_timeout(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    mp.start_processes(_fault_main, args=(ports, str(tmp_path)), nprocs=4, start_method="forkserver")
    for scenario, limit in (("engine_dies", 3.0), ("engine_stalls", TIMEOUT_S + 3), ("learner_dies", 3.0),
                            ("learner_stalls", STALL_WAIT_S + 3)):
        seconds, result = (tmp_path / f"{scenario}.txt").read_text().split("\n", 1)
        assert "no error" not in result, scenario
        assert "Connection closed" in result or "Timed out" in result, result
        assert float(seconds) < limit, f"{scenario}: raised after {seconds} s\n{result}"
