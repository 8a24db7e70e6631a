"""Guidance for all-fail groups (docs/guidance.md), measured on the bundled model in three suites:

- ``quickstart``: the quickstart for its steps (``train.steps``) per arm and seed (``quickstart_seeds.py``,
  records named ``<arm>-seed<n>`` in benchmarks/results/quickstart_seeds.json), held-out accuracy in float32
  overall and on items whose answer is negative (the minus sign the base model almost never writes).
- ``tasks``: reasoning-gym tasks that no shipped config is tuned on, at their default difficulty, run as
  ``polyrl train configs/quickstart.yaml`` with only the task swapped (its 7.5-minute training budget),
  held-out accuracy before and after; records in benchmarks/results/guidance.json.
- ``strata``: a task's arm for all of its steps, then accuracy by difficulty stratum (below).

    python benchmarks/guidance.py quickstart --arms today guided-luffy guided-unshaped --seeds 0 1 2
    python benchmarks/guidance.py tasks --arms today guided-unshaped --tasks products aiw
    python benchmarks/guidance.py strata --arms recipe --tasks products   # accuracy by difficulty, before and after
    python benchmarks/guidance.py table          # the docs' tables again, from the results files

``strata`` trains as ``tasks`` does but for all of the arm's steps (no time budget: the same result under any
load), keeps the trained model and measures it and the base model on each difficulty stratum of the task
(``STRATA``: products by the factors' digit count), 100 held-out items each: where the gain came from, and
what the task leaves to learn.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block  # noqa: E402
from large_data import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
QUICKSTART_RESULTS = ROOT / "benchmarks" / "results" / "quickstart_seeds.json"
RESULTS = ROOT / "benchmarks" / "results" / "guidance.json"
DOC = ROOT / "docs" / "guidance.md"
TASKS_DOC = ROOT / "docs" / "results" / "guidance-tasks.md"
AT_90 = ["train.steps=90"]  # the arms measured when the quickstart took 90 steps keep them
ARMS = {
    "today": ["guidance.reference=false", *AT_90],  # the recipe before guidance
    "guided-luffy": ["guidance.reference=true", "guidance.shaping_gamma=0.1", *AT_90],
    "guided-unshaped": ["guidance.reference=true", "guidance.shaping_gamma=null", *AT_90],
    "guided-unshaped-anneal": ["guidance.reference=true", "guidance.shaping_gamma=null",
                               "guidance.anneal_steps=60", *AT_90],
    "guided-selected": ["guidance.reference=true", "guidance.shaping_gamma=null",
                        "rollout.prompt_selection.candidates=4", *AT_90],
    "selected": ["guidance.reference=false", "rollout.prompt_selection.candidates=4", *AT_90],
    "guided-hinted": ["guidance.reference=true", "guidance.shaping_gamma=null", "guidance.hint_fraction=0.5", *AT_90],
    "guided-hinted-selected": ["guidance.reference=true", "guidance.shaping_gamma=null",
                               "guidance.hint_fraction=0.5", "rollout.prompt_selection.candidates=4", *AT_90],
    "guided-pass-at-4": ["guidance.reference=true", "guidance.shaping_gamma=null",
                         "algorithm.advantage.estimator=pass_at_k", "algorithm.advantage.kwargs.k=4", *AT_90],
    # the quickstart's sampling entropy falls from about 2.8 to 0.1 nats a token over 90 steps
    "guided-entropy-0.3": ["guidance.reference=true", "guidance.shaping_gamma=null",
                           "algorithm.regularisers.entropy_target=0.3", *AT_90],
    # the recipe for fewer steps than it ships with (its learning rate decays to 0 at train.steps either way)
    "recipe-90-steps": AT_90,
    "recipe-135-steps": ["train.steps=135"],
    "recipe": [],  # configs/quickstart.yaml as it ships
    "recipe-unguided": ["guidance.reference=false"],  # what guidance adds to it
    "recipe-sft": ["algorithm.regularisers.sft_coef=0.1"],  # SFT on the batch's successes on top of it
    "recipe-luffy": ["guidance.shaping_gamma=0.1"],  # LUFFY's shaping of the reference instead of none
    "recipe-anneal": ["guidance.anneal_steps=120"],  # HAPO's annealing: no references after two thirds
}
TASKS = ["products", "largest_island", "aiw"]
# A task's difficulty strata: its default draws each of these equally often.
STRATA = {"products": {f"{d}-digit factors": {"min_digits": d, "max_digits": d} for d in range(1, 6)}}


def arm_steps(arm: str) -> int:
    """The arm's steps: its ``train.steps`` override, else the quickstart's."""
    shipped = quickstart_config()["train"]["steps"]
    return next((int(o.split("=", 1)[1]) for o in ARMS[arm] if o.startswith("train.steps=")), shipped)


def run_quickstart(arm: str, seed: int) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quickstart_seeds.py"), "--name", f"{arm}-seed{seed}",
           "--steps", str(arm_steps(arm)), "--seed", str(seed), *ARMS[arm]]
    subprocess.run(cmd, check=True)


def run_task(arm: str, task: str, seed: int, workdir: Path, extra: tuple[str, ...] = ()) -> dict:
    out = workdir / f"{task}-{arm}-{seed}"
    cmd = ["polyrl", "train", str(QUICKSTART), f"tasks.0.name={task}", "tasks.0.params={}",
           f"train.seed={seed}", "logging.progress=false", *ARMS[arm], *extra, "-o", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{task} / {arm}: polyrl train failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "task": task, "arm": arm, "seed": seed, "overrides": ARMS[arm],
        "before": summary["eval_before"][task], "after": summary["eval_after"][task],
        "steps": summary["steps"], "train_time_s": summary["train_time_s"], "wall_s": time.perf_counter() - t0,
        "guided": sum(r.get("guidance/guided", 0) for r in rows),
        "zero_gradient_steps": sum(r.get("zero_gradient", 0) for r in rows),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


@functools.cache
def quickstart_config() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


@functools.cache  # the base model's strata are the same for every arm: measured once per task and seed
def stratum_accuracy(model: str, task: str, params_json: str, seed: int) -> float:
    """Greedy accuracy of ``model`` on 100 held-out items of ``task`` drawn with ``params_json``, prompted as
    the quickstart prompts (its suffix and answer parsing, float32)."""
    prompt = quickstart_config()["tasks"][0]
    cmd = ["polyrl", "eval", "--model", model, "--task", task, "--params", params_json, "--n", "100",
           "--seed", str(seed), "--prompt-suffix", prompt["prompt_suffix"], "--answer", prompt["answer"], "--fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["accuracy"]


def run_strata(arm: str, task: str, seed: int, workdir: Path) -> dict:
    # All of the arm's steps, however long they take: a stratum's accuracy is then the same on any machine
    record = run_task(arm, task, seed, workdir, extra=("train.max_minutes=null",))
    trained = str(workdir / f"{task}-{arm}-{seed}" / "checkpoints" / f"step-{record['steps']}")
    base = quickstart_config()["model"]["name"]
    record["strata"] = {name: {"before": stratum_accuracy(base, task, json.dumps(params), seed),
                               "after": stratum_accuracy(trained, task, json.dumps(params), seed)}
                        for name, params in STRATA[task].items()}
    return record


def strata_table(results: dict) -> str:
    lines = ["| task | arm | seed | stratum | before | after |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results.get("strata", []):
        for name, acc in r["strata"].items():
            lines.append(f"| {r['task']} | {r['arm']} | {r['seed']} | {name} | {100 * acc['before']:.0f} % "
                         f"| {100 * acc['after']:.0f} % |")
    return "\n".join(lines)


def _negative(record: dict) -> str:
    return record["heldout"]["by_category"]["minus, negative answer"]


def quickstart_table() -> str:
    runs = json.loads(QUICKSTART_RESULTS.read_text())["runs"] if QUICKSTART_RESULTS.exists() else []
    lines = ["| arm | seeds | held-out (each seed) | worst | median | negative answers (each seed) | groups guided "
             "| training (median) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in ARMS:
        latest = {r["seed"]: r for r in runs  # a seed run again: its latest record
                  if r["name"].rsplit("-seed", 1)[0] == arm and r["steps"] == arm_steps(arm)}
        mine = [latest[seed] for seed in sorted(latest)]
        if not mine:
            continue
        acc = [100 * r["heldout"]["accuracy"] for r in mine]
        overrides = " ".join(ARMS[arm]) or f"configs/quickstart.yaml as it ships, {arm_steps(arm)} steps"
        seeds = ", ".join(str(r["seed"]) for r in mine)
        each = ", ".join(f"{a:.1f}" for a in acc)
        negative = ", ".join(_negative(r) for r in mine)
        guided = ", ".join(str(r.get("guided_groups", 0)) for r in mine)
        minutes = median(r["train_time_s"] for r in mine) / 60
        lines.append(f"| {arm} ({overrides}) | {seeds} | {each} % | {min(acc):.1f} % | {median(acc):.1f} % "
                     f"| {negative} | {guided} | {minutes:.1f} min |")
    return "\n".join(lines)


def tasks_table(results: dict) -> str:
    m = results.get("machine", {})
    lines = [f"{m.get('date', '')}; {m.get('cpu_model', '')}, {m.get('cores', '')} cores.", "",
             "| task | arm | held-out before | after | gain | steps | training | groups guided | zero-gradient steps "
             "| measured |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results.get("runs", []):
        lines.append(f"| {r['task']} | {r['arm']} | {100 * r['before']:.1f} % | {100 * r['after']:.1f} % | "
                     f"{100 * (r['after'] - r['before']):+.1f} pts | {r['steps']} | {r['train_time_s'] / 60:.1f} min | "
                     f"{r['guided']:.0f} | {r['zero_gradient_steps']:.0f} | {r['measured_at'][:10]} |")
    return "\n".join(lines)


def write_tables() -> None:
    replace_block(DOC, "<!-- guidance-quickstart:start -->", "<!-- guidance-quickstart:end -->", quickstart_table(),
                  "The quickstart, three seeds")
    if RESULTS.exists():
        results = json.loads(RESULTS.read_text())
        replace_block(TASKS_DOC, "<!-- guidance-tasks:start -->", "<!-- guidance-tasks:end -->",
                      tasks_table(results), "Tasks no config was tuned on")
        if results.get("strata"):
            replace_block(TASKS_DOC, "<!-- guidance-strata:start -->", "<!-- guidance-strata:end -->",
                          strata_table(results), "Accuracy by difficulty")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=["quickstart", "tasks", "strata", "table"])
    p.add_argument("--arms", nargs="+", default=["today", "guided-unshaped"], choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--tasks", nargs="+", default=TASKS)
    args = p.parse_args()
    if args.suite == "quickstart":
        for arm in args.arms:
            for seed in args.seeds:
                run_quickstart(arm, seed)
    elif args.suite == "tasks":
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
        results["machine"] = machine()
        with tempfile.TemporaryDirectory(prefix="polyrl-guidance-") as tmp:
            for task in args.tasks:
                for arm in args.arms:
                    for seed in args.seeds:
                        results["runs"] = [r for r in results["runs"]
                                           if (r["task"], r["arm"], r["seed"]) != (task, arm, seed)]
                        results["runs"].append(run_task(arm, task, seed, Path(tmp)))
                        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        results["machine"]["load_average_at_end"] = os.getloadavg()
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    elif args.suite == "strata":
        if unknown := [t for t in args.tasks if t not in STRATA]:
            p.error(f"no strata for {', '.join(unknown)}: STRATA has {', '.join(STRATA)}")
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
        with tempfile.TemporaryDirectory(prefix="polyrl-strata-") as tmp:
            for task in args.tasks:
                for arm in args.arms:
                    for seed in args.seeds:
                        record = run_strata(arm, task, seed, Path(tmp))
                        results["strata"] = [r for r in results.get("strata", [])
                                             if (r["task"], r["arm"], r["seed"]) != (task, arm, seed)] + [record]
                        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_tables()
    print(quickstart_table())


if __name__ == "__main__":
    main()
