"""Weight sync from 2 FSDP2 learner ranks to 1 engine process over gloo on this CPU (polyrl/parallel/weight_sync.py).

For each model, 3 processes (2 learner ranks sharding the policy with FSDP2, 1 engine holding a whole copy)
measure, one thread each:

- ``raw_broadcast``: gloo's own broadcast of one buffer from learner rank 0 to the engine (the wire's ceiling);
- ``bucketed``: ``WeightSender.send`` / ``WeightReceiver.receive`` at each bucket size, shards sent to rank 0
  (the default); once more with ``full_tensor()``'s all-gather instead, and once with bf16 on the wire: the
  learners' gathers, packing, broadcasts, copies into the engine's parameters, acknowledgement;
- ``pickled_state_dict`` (the object-store path of runtime.kind ray, as far as the bytes go): the learners gather
  a whole state dict onto rank 0 (``full_tensor()``, timed apart), which pickles it and sends the bytes in one
  broadcast; the engine unpickles and loads it. Only where it fits in memory (``--pickled``).

Models: the 135M SmolLM2 (converted once from the bundled GGUF) and a Llama-3.2-1B-shaped model with random
weights (hidden 2048, 16 layers, 32 heads, 8 key/value heads, MLP 8192, vocabulary 49152, tied embeddings),
built on the meta device so each learner materialises only its shard. After the timed syncs every parameter's
float64 sum is compared between the learners' gathered weights and the engine's.

The configurations alternate (each round syncs once with each), so a machine whose speed drifts moves all alike.

    python benchmarks/weight_sync.py      # ~4 min on 2 cores; writes benchmarks/results/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polyrl import (  # noqa: E402
    WeightReceiver,
    WeightSender,
    canonical_name,
    iter_full_state,
    join_sync_group,
)

MB = 1_000_000  # 1 MB is 10**6 bytes, as in WeightSender(bucket_mb=...)

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def _log(who: str, what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {who}] {what}", file=sys.stderr, flush=True)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in kB on Linux


def _build(model_name: str, sharded: bool) -> torch.nn.Module:
    """The policy; with ``sharded`` FSDP2 over the learner group (each decoder layer, then the root)."""
    from torch.distributed.fsdp import fully_shard

    if model_name == "smollm2-135m-instruct":
        from polyrl import load_model

        model = load_model(model_name)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B))
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if model_name != "smollm2-135m-instruct":
        model.to_empty(device="cpu")  # each learner allocates its shards only; the engine a whole model
        if not sharded:
            model.tie_weights()  # to_empty gave the head its own tensor (FSDP's root keeps the learners' tie)
        gen = torch.Generator().manual_seed(torch.distributed.get_rank() if sharded else 0)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.normal_(0.0, 0.02, generator=gen)
    return model


def _param_sums(pairs) -> dict[str, float]:
    return {n: float(t.double().sum()) for n, t in pairs}


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-time allocations and connections
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _pickled_send(model: torch.nn.Module, group, is_learner0: bool, gather_s: list[float]) -> int:
    """Rank 0: a whole state dict, pickled, length then bytes in two broadcasts. Every learner gathers (an
    all-gather per tensor; its time goes to ``gather_s``)."""
    state = {}
    t = time.perf_counter()
    for name, full in iter_full_state(model):
        if is_learner0:
            state[name] = full.clone()
    gather_s.append(time.perf_counter() - t)
    if not is_learner0:
        return 0
    payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    del state
    group.broadcast(torch.tensor([len(payload)], dtype=torch.int64)).wait()
    group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8)).wait()
    group.all_min(0)
    return len(payload)


def _pickled_receive(model: torch.nn.Module, group) -> None:
    n = torch.zeros(1, dtype=torch.int64)
    group.broadcast(n).wait()
    raw = torch.empty(int(n), dtype=torch.uint8)
    group.broadcast(raw).wait()
    state = pickle.loads(memoryview(raw.numpy()))
    del raw
    model.load_state_dict(state, strict=False)  # tied head: not in named_parameters
    group.all_min(0)


def _learner(rank: int, args: dict, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['ports'][0]}", rank=rank, world_size=2)
    group = join_sync_group("learner", rank, 1, "127.0.0.1", args["ports"][1], timeout_s=600)
    model = _build(args["model"], sharded=True)
    _log(f"learner{rank}", f"built, peak RSS {_peak_rss_gb():.2f} GB")
    res: dict = {"rss_after_build_gb": _peak_rss_gb(), "bucketed": []}
    if rank == 0:
        raw = {}
        for mb in args["buckets"]:
            buf = torch.zeros(int(mb * MB), dtype=torch.uint8)
            raw[mb] = _timed(lambda b=buf: group.broadcast(b).wait(), args["repeats"])
        res["raw_broadcast"] = raw
    version = 0
    senders = [WeightSender(model, group, bucket_mb=mb, wire_dtype=getattr(torch, wire) if wire else None,
                            point_to_point=p2p) for mb, wire, p2p in args["configs"]]
    runs: list[list[dict]] = [[] for _ in senders]
    for _ in range(args["repeats"] + 1):  # the configurations alternate, so a machine's drift touches all; the
        for k, sender in enumerate(senders):  # first round is a warm-up
            runs[k].append(sender.send(version))
            version += 1
    for (mb, wire, p2p), r in zip(args["configs"], runs, strict=True):
        res["bucketed"].append({"bucket_mb": mb, "wire_dtype": wire or "float32",
                                "gather": "point_to_point" if p2p else "full_tensor", "runs": r[1:]})
    res["rss_after_bucketed_gb"] = _peak_rss_gb()
    _log(f"learner{rank}", "bucketed syncs done")
    res["sums"] = _param_sums(iter_full_state(model))
    if args["pickled"]:
        nbytes, gather_s = [], []
        res["pickled_s"] = _timed(lambda: nbytes.append(_pickled_send(model, group, rank == 0, gather_s)),
                                  args["repeats"])
        res["pickled_bytes"], res["pickled_gather_s"] = nbytes[-1], gather_s[1:]
        res["rss_after_pickled_gb"] = _peak_rss_gb()
    if rank == 0:
        WeightSender(model, group).close()
        (out / "learner0.json").write_text(json.dumps(res))
    else:
        (out / "learner1.json").write_text(json.dumps({k: res[k] for k in res if k.startswith("rss")}))
    _log(f"learner{rank}", "done")
    dist.barrier()  # both ranks leave together
    dist.destroy_process_group()


def _engine(args: dict, out: Path) -> None:
    group = join_sync_group("engine", 0, 1, "127.0.0.1", args["ports"][1], timeout_s=600)
    model = _build(args["model"], sharded=False)
    res: dict = {"rss_after_build_gb": _peak_rss_gb(), "receives": []}
    for mb in args["buckets"]:
        buf = torch.zeros(int(mb * MB), dtype=torch.uint8)
        _timed(lambda b=buf: group.broadcast(b).wait(), args["repeats"])
    receiver = WeightReceiver(group, model=model)
    rounds = [[receiver.receive() for _ in args["configs"]] for _ in range(args["repeats"] + 1)]
    res["receives"] = [[r[k] for r in rounds[1:]] for k in range(len(args["configs"]))]
    res["rss_after_bucketed_gb"] = _peak_rss_gb()
    res["sums"] = _param_sums((canonical_name(n), p.detach()) for n, p in model.named_parameters())
    if args["pickled"]:
        _timed(lambda: _pickled_receive(model, group), args["repeats"])
        res["rss_after_pickled_gb"] = _peak_rss_gb()
    assert receiver.receive() is None
    (out / "engine.json").write_text(json.dumps(res))


def _main(i: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)  # 3 processes on 2 cores
    if i < 2:
        _learner(i, args, Path(out))
    else:
        _engine(args, Path(out))


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(model: str, args: argparse.Namespace, tmp: Path) -> dict:
    from polyrl import free_port

    # bf16 on the wire first: the weight check after the last sync needs the engine to hold exact float32.
    small = min(args.bucket_mb)
    configs = [(small, "bfloat16", True), (small, None, False)] + [(mb, None, True) for mb in args.bucket_mb]
    pickled = model in args.pickled
    spec = {"model": model, "ports": [free_port(), free_port()], "buckets": args.bucket_mb, "configs": configs,
            "repeats": args.repeats, "pickled": pickled}
    t0 = time.perf_counter()
    mp.start_processes(_main, args=(spec, str(tmp)), nprocs=3, start_method="spawn")
    wall = time.perf_counter() - t0
    l0, l1, eng = (json.loads((tmp / f).read_text()) for f in ("learner0.json", "learner1.json", "engine.json"))
    mismatched = [n for n in l0["sums"] if l0["sums"][n] != eng["sums"].get(n)]
    full_bytes = l0["bucketed"][-1]["runs"][0]["sync/bytes"]  # float32
    rows = []
    for mb, secs in l0["raw_broadcast"].items():
        rows.append({"path": "raw_broadcast", "bucket_mb": float(mb), "seconds": secs,
                     "mb_per_s_median": round(float(mb) / _median(secs), 1)})
    for cfg, recv in zip(l0["bucketed"], eng["receives"], strict=True):
        runs = cfg["runs"]
        rows.append({
            "path": "bucketed", "bucket_mb": cfg["bucket_mb"], "wire_dtype": cfg["wire_dtype"], "gather": cfg["gather"],
            "bytes": int(runs[0]["sync/bytes"]), "buckets": int(runs[0]["sync/buckets"]),
            "seconds": [round(r["sync/time_s"], 3) for r in runs],
            "gather_s": [round(r["sync/gather_s"], 3) for r in runs],
            "engine_seconds": [round(r["sync/time_s"], 3) for r in recv],
            "mb_per_s": [round(r["sync/mb_per_s"], 1) for r in runs],
            "mb_per_s_median": round(_median([r["sync/mb_per_s"] for r in runs]), 1),
            "model_mb_per_s_median": round(full_bytes / MB / _median([r["sync/time_s"] for r in runs]), 1),
        })
    if pickled:
        secs = l0["pickled_s"]
        rows.append({"path": "pickled_state_dict", "bytes": l0["pickled_bytes"], "seconds": [round(s, 3) for s in secs],
                     "gather_s": [round(s, 3) for s in l0["pickled_gather_s"]],
                     "mb_per_s_median": round(full_bytes / MB / _median(secs), 1),
                     "mb_per_s_without_gather_median": round(full_bytes / MB / _median(
                         [s - g for s, g in zip(secs, l0["pickled_gather_s"], strict=True)]), 1)})
    memory = {f"{who}_{k}": round(v, 2) for who, d in (("learner0", l0), ("learner1", l1), ("engine", eng))
              for k, v in d.items() if k.startswith("rss")}
    params = len(l0["sums"])
    return {"model": model, "parameter_tensors": params, "model_bytes": int(full_bytes),
            "weights_equal_after_sync": not mismatched, "mismatched": mismatched[:5], "wall_s": round(wall, 1),
            "peak_rss_gb": memory, "results": rows}


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()

    def field(key: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith(key)), "")

    flags = field("flags").split()
    mem_gb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal")) / 1e6
    return {"cpu": field("model name") or platform.processor(), "cpu_family": field("cpu family"),
            "cpu_model": field("model"), "avx512_bf16": "avx512_bf16" in flags, "cores": os.cpu_count(),
            "memory_gb": round(mem_gb, 1), "torch": torch.__version__, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "llama-1b-random"])
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[32.0, 256.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pickled", nargs="*", default=["smollm2-135m-instruct"],
                        help="models to also send as one pickled state dict (the 1B one needs ~26 GB here)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_sync.json")
    args = parser.parse_args()
    if "smollm2-135m-instruct" in args.models:
        from polyrl import smollm2_dir

        smollm2_dir()  # convert the GGUF once, before three processes want it
    import tempfile

    meta = {"machine": machine(), "learner_ranks": 2, "engines": 1, "backend": "gloo", "threads_per_process": 1,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "repeats": args.repeats,
            "command": "python benchmarks/weight_sync.py " + " ".join(sys.argv[1:])}
    models = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            models.append(measure(model, args, Path(tmp)))
        print(json.dumps({k: v for k, v in models[-1].items() if k != "results"}))
        for row in models[-1]["results"]:
            print(" ", row["path"], row.get("bucket_mb"), row.get("wire_dtype", ""), row.get("gather", ""),
                  row["mb_per_s_median"], "MB/s")
    meta["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "models": models}, indent=1) + "\n")


if __name__ == "__main__":
    main()
