"""Peak memory per rank of one learner update of a ~1B model, at world size 1 and sharded over 2 ranks (FSDP2).

The model is Llama-3.2-1B-shaped (``models/synthetic.py``, ``llama3`` at ``1b``: hidden 2048, MLP 8192, 32 query
and 8 key/value heads, tied embeddings, vocabulary 49152), random float32 weights, built from its config in every
rank with the same seed (as every rank of ``polyrl train`` loads the whole model) and given polyrl's float32
attention as ``load_model`` does. ``--layers`` trims the decoder to fewer layers of the same width (16 is the
full model). The batch is the quickstart's shape: 2 groups x 8 samples, prompts of about 60 tokens, responses
of about 40; the learner is built as the quickstart builds it (GRPO advantages given, ppo_clip with clip-high
0.28, no KL reference, bf16 autocast, one micro-batch of 16, AdamW lr 3e-5 with the linear schedule).

Each configuration runs in fresh processes (``parallel/launch.launch_ranks``: 2 threads for one rank, 1 each
for two). Per rank and per phase (build the model, build the Learner, which shards it, then each update) the
kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``) and read back (VmHWM), so each
phase's own peak is known; ``ru_maxrss`` is the whole process's peak. The bytes of parameters, gradients and
AdamW moments this rank holds are added up from tensor sizes (a DTensor's local shard), and the tensors autograd
saves for the backward pass are tallied (unique storages) to show what the activations hold. The parent samples
the ranks' summed RSS (the machine's share of the benchmark) every 0.2 s.

The summed peak of a configuration is predicted first (a line in the layer count through the two largest
measured at that world size). One that cannot fit in this machine's memory is not started and is recorded as
not fitting, with the prediction; one that could waits (``--wait-minutes``) until other jobs leave it that
memory and a reserve. Each rank runs under an address-space limit of its share, so a wrong prediction fails
one allocation instead of calling the kernel's OOM killer. Results: benchmarks/results/sharded_memory.json.

    python benchmarks/sharded_memory.py                      # layers 2 to 16; ~30 min on 2 shared cores
    python benchmarks/sharded_memory.py --layers 2 --updates 1 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
RESERVE_GB = 3.5
"""Memory left to the machine's other jobs when deciding whether a configuration fits."""
IDLE_USE_GB = 2.0
"""Memory the machine uses with nothing of this benchmark running and other jobs idle."""


# ---------------------------------------------------------------------------------------------- memory readers


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss() -> float:
    return _status_kb("VmRSS") * 1024 / GB


def reset_peak() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> float:
    return _status_kb("VmHWM") * 1024 / GB


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GB
    raise KeyError("MemAvailable")


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor: this rank's shard
        t = t.to_local()
    return t.numel() * t.element_size()


class SavedTensors:
    """Tally of the tensors autograd saves for the backward pass (one count per storage)."""

    def __init__(self, weight_shapes: set[tuple[int, ...]]) -> None:
        self.weight_shapes = weight_shapes
        self.seen: dict[int, tuple[int, torch.dtype, bool]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without a plain storage
            return t
        if key and key not in self.seen:
            is_weight_cast = t.dtype == torch.bfloat16 and tuple(t.shape) in self.weight_shapes
            self.seen[key] = (nbytes, t.dtype, is_weight_cast)
        return t

    def summary(self) -> dict:
        total = sum(n for n, _, _ in self.seen.values())
        casts = sum(n for n, _, w in self.seen.values() if w)
        return {"saved_for_backward_gb": total / GB, "of_which_bf16_weight_casts_gb": casts / GB,
                "of_which_activations_gb": (total - casts) / GB}


# ------------------------------------------------------------------------------------------------ the workload


def build_model(layers: int, seed: int = 0):
    """The llama3 ``1b`` synthetic model with ``layers`` decoder layers, float32, as ``load_model`` sets it up."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from polyrl import synthetic_model_config, use_float32_attention

    hf_logging.set_verbosity_error()  # transformers' warnings and progress bars off, as load_model has them
    hf_logging.disable_progress_bar()
    config = synthetic_model_config("llama3", "1b")
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = True
    use_float32_attention(model)
    return model


def quickstart_batch(seed: int = 0, groups: int = 2, group_size: int = 8, vocab: int = 49152):
    """Trajectories of the quickstart's shape: ``groups`` prompts of ~60 tokens, ``group_size`` responses each
    of 30 to 50 tokens (mean ~40), rewards 0/1 with GRPO advantages (reward minus the group mean, over its std)."""
    from polyrl import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(58 + 4 * g)]
        rewards = [float(i % 3 == 0) for i in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((r - mean) ** 2 for r in rewards) / group_size) ** 0.5
        for i in range(group_size):
            resp = [rng.randrange(3, vocab) for _ in range(30 + rng.randrange(21))]
            out.append(Trajectory(
                task="chain_sum", item_id=g, group_id=g, input_ids=prompt + resp,
                loss_mask=[0] * len(prompt) + [1] * len(resp),
                logprobs=[0.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in resp],
                versions=[-1] * len(prompt) + [0] * len(resp),
                reward=rewards[i], advantage=(rewards[i] - mean) / (std + 1e-6),
            ))
    return out


def learner_configs():
    from polyrl import AlgorithmConfig, OptimConfig

    algo = AlgorithmConfig(advantage="grpo", loss={"name": "ppo_clip", "clip_high": 0.28},
                           regularisers={"track_kl": False})
    optim = OptimConfig(lr=3.0e-5, schedule="linear", micro_batch_size=16)
    return algo, optim


def _state_bytes(model, learner) -> dict:
    params = list(model.parameters())
    opt = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    b = {"parameters": sum(map(local_bytes, params)), "gradients": sum(local_bytes(p.grad) for p in params),
         "optimizer_state": sum(map(local_bytes, opt))}
    b["total"] = sum(b.values())
    return {k: v / GB for k, v in b.items()}


def _rank(layers: int, updates: int, out_dir: str, budget_gb: float, checkpointing: bool = False) -> None:
    """One rank's measurement; writes ``rank-<r>.json`` in ``out_dir``."""
    from polyrl import Ranks, barrier, join_group, leave_group

    world = int(os.environ["WORLD_SIZE"])
    # A failed allocation instead of the OOM killer when this rank outgrows its share of the machine.
    vsz = psutil.Process().memory_info().vms / GB
    limit = int((vsz + budget_gb) * GB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    ranks = join_group("gloo", 1800.0, torch.device("cpu")) if world > 1 else Ranks()
    from polyrl import Learner, LearnerConfig, record_passes

    rec: dict = {"rank": ranks.rank, "world_size": ranks.world_size, "threads": torch.get_num_threads(),
                 "address_space_limit_gb": limit / GB, "phases": {}}
    phases = rec["phases"]
    try:
        phases["start"] = {"rss_gb": rss()}
        reset_peak()
        t0 = time.perf_counter()
        model = build_model(layers)
        phases["build_model"] = {"seconds": time.perf_counter() - t0, "peak_rss_gb": peak(), "rss_after_gb": rss()}
        rec["parameters"] = sum(p.numel() for p in model.parameters())
        weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        barrier(ranks)
        reset_peak()
        t0 = time.perf_counter()
        algo, optim = learner_configs()
        sharding = LearnerConfig(activation_checkpointing=checkpointing)
        learner = Learner(model, algo, optim, 1.0, True, pad_id=2, total_steps=90, sharding=sharding, ranks=ranks)
        gc.collect()
        phases["build_learner"] = {"seconds": time.perf_counter() - t0, "peak_rss_gb": peak(), "rss_after_gb": rss(),
                                   "held": _state_bytes(model, learner)}
        trajectories = quickstart_batch()
        for k in range(updates):
            barrier(ranks)
            saved = SavedTensors(weight_shapes)
            reset_peak()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), record_passes() as passes:
                metrics = learner.update(trajectories)
            seconds = time.perf_counter() - t0
            phases[f"update_{k + 1}"] = {
                "seconds": seconds, "peak_rss_gb": peak(), "rss_after_gb": rss(),
                "held_after": _state_bytes(model, learner), **saved.summary(),
                "decoder_passes_with_grad": sum(p.with_grad for p in passes),
                "decoder_passes_without_grad": sum(not p.with_grad for p in passes),
                "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            }
        rec["ru_maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        rec["ok"] = True
    except (RuntimeError, MemoryError) as exc:  # e.g. an allocation over the address-space limit
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        rec["ru_maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    finally:
        Path(out_dir, f"rank-{ranks.rank}.json").write_text(json.dumps(rec, indent=2))
        if world > 1:
            leave_group()


# ------------------------------------------------------------------------------------------------------ parent


class TotalRss:
    """Summed RSS of this process's children, sampled every ``every`` seconds, and the least MemAvailable."""

    def __init__(self, every: float = 0.2) -> None:
        self.every, self.max_total, self.min_available = every, 0.0, mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += child.memory_info().rss
            self.max_total = max(self.max_total, total / GB)
            self.min_available = min(self.min_available, mem_available())
            self._stop.wait(self.every)

    def __enter__(self) -> TotalRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


EMBEDDING_BYTES = 49152 * 2048 * 4
"""The tied embedding / output head in float32."""


def parameter_bytes(layers: int) -> float:
    """Float32 bytes of the model's parameters (tied head once), counted on the meta device."""
    with torch.device("meta"):
        model = build_model(layers)
    return sum(p.numel() for p in model.parameters()) * 4


def predict_total(layers: int, world: int, measured: dict) -> tuple[float, str]:
    """Predicted summed peak RSS of ``world`` ranks at ``layers``: a line through two measured layer counts at
    this world size when there are two, else a rough count (4 float32 copies of the weights over the ranks, a
    bf16 copy and 1.5 GB of libraries and activations per rank)."""
    points = sorted((lay, r["total_peak_rss_gb"]) for (lay, w), r in measured.items() if w == world and r.get("ok"))
    if len(points) >= 2:
        (l0, p0), (l1, p1) = points[-2], points[-1]
        return p0 + (p1 - p0) * (layers - l0) / (l1 - l0), f"linear in layers through {l0} and {l1} layers"
    w = parameter_bytes(layers) / GB
    return 4 * w + world * (w / 8 + 1.5), "4 float32 copies + per rank a bf16 copy and 1.5 GB"


def too_big(predicted: float, total: float) -> str:
    allowed = total - RESERVE_GB - IDLE_USE_GB
    return (f"not started, does not fit here: predicted {predicted:.2f} GB over the ranks, "
            f"{1000 * (predicted - allowed):.0f} MB above the {allowed:.2f} GB this benchmark allows itself "
            f"({total:.1f} GB of memory, less about {IDLE_USE_GB} GB "
            f"the system uses when idle and {RESERVE_GB} GB kept for other jobs)")


def wait_for_memory(needed: float, minutes: float) -> float:
    """Wait up to ``minutes`` until ``needed`` GB plus the reserve are available (other jobs share the
    machine); returns what is available then."""
    deadline = time.monotonic() + 60 * minutes
    while (available := mem_available()) - RESERVE_GB < needed and time.monotonic() < deadline:
        time.sleep(10)
    return available


def run_config(layers: int, world: int, updates: int, measured: dict, wait_minutes: float,
               checkpointing: bool = False) -> dict:
    from polyrl import RankFailedError, launch_ranks

    available = mem_available()
    predicted, how = predict_total(layers, world, measured)
    if checkpointing:  # the fitted line is of runs that kept activations: bound by the sharded state instead
        predicted = 4 * parameter_bytes(layers) / GB + world * 1.0
        how = "activation checkpointing: float32 weights, gradients and AdamW over the ranks, plus 1 GB per rank"
    weights, embedding = parameter_bytes(layers) / GB, EMBEDDING_BYTES / GB
    entry: dict = {
        "layers": layers, "world_size": world, "mem_available_before_gb": available,
        "load_average_before": os.getloadavg(),
        "params_grads_adamw_per_rank_from_sizes_gb": {
            "parameters": weights / world, "gradients": weights / world, "optimizer_state": 2 * weights / world,
            "total": 4 * weights / world},
        "bf16_decoder_weights_gb": (weights - embedding) / 2, "bf16_embedding_gb": embedding / 2,
        "predicted_total_peak_gb": predicted, "predicted_per_rank_peak_gb": predicted / world, "prediction": how,
        "activation_checkpointing": checkpointing}
    total = psutil.virtual_memory().total / GB
    if predicted > total - RESERVE_GB - IDLE_USE_GB:
        entry.update(ok=False, ran=False, reason=too_big(predicted, total))
        return entry
    available = wait_for_memory(predicted, wait_minutes)
    entry["mem_available_before_gb"] = available
    if predicted > available - RESERVE_GB:
        entry.update(ok=False, ran=False, reason=(
            f"not run: predicted {predicted:.1f} GB over the ranks, only {available:.1f} GB available after "
            f"waiting {wait_minutes} min for other jobs (keeping {RESERVE_GB} GB for them)"))
        return entry
    budget = (available - RESERVE_GB) / world
    with tempfile.TemporaryDirectory() as out, TotalRss() as sampler:
        t0 = time.perf_counter()
        try:
            launch_ranks(world, torch.device("cpu"), _rank, layers, updates, out, budget, checkpointing)
            failure = None
        except RankFailedError as exc:
            failure = str(exc)
        entry["wall_seconds"] = time.perf_counter() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))]
    entry["load_average_after"] = os.getloadavg()
    entry.update(ran=True, ok=failure is None and len(ranks) == world and all(r["ok"] for r in ranks),
                 ranks=ranks, total_peak_rss_sampled_gb=sampler.max_total,
                 min_mem_available_gb=sampler.min_available)
    if failure:
        entry["failure"] = failure
    if ranks:
        entry["parameters"] = ranks[0].get("parameters")
        entry["per_rank_peak_rss_gb"] = max(r["ru_maxrss_gb"] for r in ranks)
        entry["total_peak_rss_gb"] = sum(r["ru_maxrss_gb"] for r in ranks)  # an upper bound: peaks may not coincide
    if entry["ok"]:
        summarise(entry, updates)
    return entry


def summarise(entry: dict, updates: int) -> None:
    """Figures of a finished configuration, taken over its ranks (the largest rank)."""
    ranks = entry["ranks"]

    def worst(phase: str, key: str) -> float:
        return max(r["phases"][phase][key] for r in ranks)

    last = f"update_{updates}"
    build_peak = max(worst("build_model", "peak_rss_gb"), worst("build_learner", "peak_rss_gb"))
    update_peak = max(worst(f"update_{k + 1}", "peak_rss_gb") for k in range(updates))
    held = max((r["phases"][last]["held_after"] for r in ranks), key=lambda h: h["total"])
    entry["summary"] = {
        "rss_after_model_built_gb": worst("build_model", "rss_after_gb"),
        "rss_after_learner_built_gb": worst("build_learner", "rss_after_gb"),
        "peak_rss_while_building_gb": build_peak,
        "peak_rss_during_updates_gb": update_peak,
        "build_transient_dominates_peak": build_peak >= update_peak,
        "params_grads_adamw_per_rank_gb": held,
        "saved_for_backward_gb": worst("update_1", "saved_for_backward_gb"),
        "bf16_weight_casts_saved_gb": worst("update_1", "of_which_bf16_weight_casts_gb"),
        "decoder_passes_with_grad": worst("update_1", "decoder_passes_with_grad"),
        "update_seconds": [worst(f"update_{k + 1}", "seconds") for k in range(updates)],
    }


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    import transformers

    return {
        "cpu": cpu, "cpu_flags": [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "usable_cores": len(os.sched_getaffinity(0)), "mem_total_gb": psutil.virtual_memory().total / GB,
        "mem_available_at_start_gb": mem_available(), "load_average_at_start": os.getloadavg(),
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main() -> None:
    global RESERVE_GB  # --reserve-gb replaces it (its default is the module's value)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 12, 16],
                    help="decoder layers (16: the whole 1B); the two largest measured predict the next")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--updates", type=int, default=2, help="updates per configuration (the first makes AdamW state)")
    ap.add_argument("--wait-minutes", type=float, default=15,
                    help="how long to wait for other jobs to free memory before a configuration that would fit")
    ap.add_argument("--findings-only", action="store_true", help="recompute the findings of --out, run nothing")
    ap.add_argument("--reserve-gb", type=float, default=RESERVE_GB,
                    help="memory kept free for other jobs when sizing and limiting the ranks")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="learner.activation_checkpointing (acts at world size > 1 only)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sharded_memory.json")
    args = ap.parse_args()
    RESERVE_GB = args.reserve_gb
    if args.findings_only:
        result = json.loads(args.out.read_text())
        for r in result["runs"]:
            if not r["ran"] and "does not fit" in r["reason"]:  # the wording of too_big, refreshed
                r["reason"] = too_big(r["predicted_total_peak_gb"], result["machine"]["mem_total_gb"])
        result["findings"] = findings(result["runs"])
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print("\n".join(result["findings"]))
        return
    algo, optim = learner_configs()
    batch = quickstart_batch()
    result: dict = {
        "machine": machine(),
        "model": "llama3 1b synthetic (Llama-3.2-1B widths: hidden 2048, MLP 8192, 32/8 heads, tied embeddings), "
                 "vocabulary 49152, random float32 weights, built from the config in every rank",
        "batch": {"groups": 2, "group_size": 8, "prompt_tokens": sorted({t.prompt_len for t in batch}),
                  "response_tokens_mean": sum(t.num_model_tokens for t in batch) / len(batch),
                  "response_tokens_range": [min(t.num_model_tokens for t in batch),
                                            max(t.num_model_tokens for t in batch)]},
        "learner": {"algorithm": algo.model_dump(include={"advantage": {"estimator"}, "loss": {"name", "clip_high"},
                                                          "regularisers": {"track_kl", "kl_coef"}}),
                    "optim": optim.model_dump(include={"lr", "schedule", "micro_batch_size", "betas"}),
                    "bf16_autocast": True, "optimizer": "torch.optim.AdamW(fused=True), as Learner builds it"},
        "method": "each configuration in fresh processes; per-phase peaks from VmHWM after /proc/self/clear_refs; "
                  "ru_maxrss per process; held bytes from tensor sizes (DTensor local shards); "
                  "total_peak_rss_gb sums the ranks' peaks (an upper bound), total_peak_rss_sampled_gb is "
                  "their summed RSS sampled every 0.2 s. Timings are indicative: the 2 cores are shared with "
                  "other jobs.",
        "runs": [],
    }
    measured: dict = {}
    for layers in sorted(args.layers):
        for world in args.worlds:
            print(f"layers {layers}, world size {world} ...", flush=True)
            entry = run_config(layers, world, args.updates, measured, args.wait_minutes, args.activation_checkpointing)
            measured[(layers, world)] = entry
            result["runs"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "ranks"}, indent=1), flush=True)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    result["findings"] = findings(result["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["findings"]))


def findings(runs: list[dict]) -> list[str]:
    out = []
    by = {(r["layers"], r["world_size"]): r for r in runs}
    for (layers, world), r in sorted(by.items()):
        if not r["ok"]:
            out.append(f"{layers} layers, world size {world}: " + (r.get("reason") or r.get("failure")
                       or "; ".join(x.get("error", "") for x in r.get("ranks", [])))
                       + f"; per rank predicted {r['predicted_per_rank_peak_gb']:.1f} GB, of which params+grads+"
                       f"AdamW {r['params_grads_adamw_per_rank_from_sizes_gb']['total']:.1f} GB from tensor sizes")
            continue
        s = r["summary"]
        out.append(
            f"{layers} layers ({r['parameters'] / 1e9:.2f}B), world size {world}: peak RSS per rank "
            f"{r['per_rank_peak_rss_gb']:.2f} GB (after building the model {s['rss_after_model_built_gb']:.2f}, "
            f"after the Learner {s['rss_after_learner_built_gb']:.2f}, peak building "
            f"{s['peak_rss_while_building_gb']:.2f}, peak updating {s['peak_rss_during_updates_gb']:.2f}); "
            f"params+grads+AdamW per rank {s['params_grads_adamw_per_rank_gb']['total']:.2f} GB; "
            f"update {', '.join(f'{x:.1f}' for x in s['update_seconds'])} s")
        casts, passes = s["bf16_weight_casts_saved_gb"], s["decoder_passes_with_grad"]
        out.append(
            f"  saved for backward {s['saved_for_backward_gb']:.2f} GB, of which bf16 weight casts {casts:.2f} GB: "
            f"{passes} decoder pass(es) x the whole decoder in bf16 ({r['bf16_decoder_weights_gb']:.2f} GB) + the "
            f"head's bf16 copy ({r['bf16_embedding_gb']:.2f} GB)"
            + (", whole on every rank: autocast's casts are not sharded" if world > 1 else ""))
        one = by.get((layers, 1))
        if world > 1 and one and one["ok"]:
            out.append(f"  per-rank peak at world size {world} / at 1: "
                       f"{r['per_rank_peak_rss_gb'] / one['per_rank_peak_rss_gb']:.2f}; summed over ranks: "
                       f"{r['total_peak_rss_gb']:.2f} GB against {one['total_peak_rss_gb']:.2f} GB")
        if world > 1:
            verdict = "sets" if s["build_transient_dominates_peak"] else "does not set"
            out.append(f"  the whole-model build before sharding (every rank) {verdict} the per-rank peak: "
                       f"{s['peak_rss_while_building_gb']:.2f} GB building against "
                       f"{s['peak_rss_during_updates_gb']:.2f} GB updating")
    return out


if __name__ == "__main__":
    sys.exit(main())
