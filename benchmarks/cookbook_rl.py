"""The Tinker cookbook's RL loop training the real model through ``polyrl serve --tinker``, beside polyrl's
native quickstart run at equal samples: held-out curves and wall times.

The cookbook side is ``tinker_cookbook.rl.train.main``, the loop its math_rl recipe runs, configured as that
recipe's ``cli_main`` configures it, with the official ``tinker`` client talking to a ``polyrl serve
smollm2-135m-instruct --tinker`` process. What differs from the recipe:

- the base URL and the model name (the served model's directory, so the cookbook's tokenizer loads offline);
- the data: the recipe's datasets come from the Hugging Face hub (its offline ``arithmetic`` env aside), so the
  env is the cookbook's own ``ProblemEnv`` over the quickstart's task, reasoning-gym ``chain_sum`` as polyrl
  builds it (same items, same prompt text, the chat template's system message as the recipe's conversation
  prefix, so the prompt tokens are polyrl's, checked below), graded by polyrl's scorer (``last_number``);
- settings passed as the recipe's flags: renderer ``qwen3_instruct`` (ChatML, SmolLM2's format), 2 groups of 8
  per batch and 64 new tokens (the quickstart's), ``loss_fn=importance_sampling`` (``rl.train``'s own default; the
  math_rl recipe's ``stable_reinforce`` is refused: Tinker documents neither its objective nor what its sampler
  records, docs/tinker.md), LoRA rank 32 (the recipe's),
  checkpoints every ``--every`` steps, no in-loop evaluation, and the learning rate (``--lr``): ``lora-rule``,
  the cookbook's LoRA factor (``hyperparam_utils.get_lora_lr_over_full_finetune_lr``, 10) times the
  quickstart's full fine-tuning rate, or ``cookbook-formula``, what ``hyperparam_utils.get_lr`` gives a
  Llama-family model of SmolLM2's width (it looks models up by name, so its formula is evaluated here).

Both runs are scored the same way afterwards: greedy float32 decoding of the quickstart's 200 held-out items
(polyrl's ``evaluate``), at step 0 and at every checkpoint.

The cookbook's declared dependencies include ``tml-renderers>=0.4.1``, which this machine's package index does
not have and which nothing on this path imports; so it is installed without dependencies, beside the few it
needs, into a directory of its own (the polyrl environment is left as it is):

    pip install --no-deps --target .cookbook tinker-cookbook==0.6.1 chz==0.4.0 blobfile==3.3.0 lxml==6.2.0 \\
        pycryptodomex==3.24.2
    PYTHONPATH=.cookbook python benchmarks/cookbook_rl.py cookbook --steps 20 --lr lora-rule
    python benchmarks/cookbook_rl.py native --steps 20
    PYTHONPATH=.cookbook python benchmarks/cookbook_rl.py eval

Each part stays under about ten minutes on the 2-core machine; ``eval`` writes
benchmarks/results/cookbook_rl.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block  # noqa: E402
from large_data import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cookbook_rl.json"
DOC = ROOT / "docs" / "tinker.md"
MODEL = "smollm2-135m-instruct"
GROUPS, GROUP_SIZE = 2, 8  # the quickstart's rollout.prompts_per_step and group_size
LORA_RANK = 32
SMOLLM2_WIDTH = 576


def learning_rate(rule: str) -> float:
    """``lora-rule``: 10 x the quickstart's full fine-tuning rate (the cookbook's LoRA factor);
    ``cookbook-formula``: ``hyperparam_utils.get_lr`` for a LoRA run of a Llama-family model SmolLM2's width."""
    if rule == "lora-rule":
        from polyrl import load_config

        return 10.0 * load_config(ROOT / "configs" / "quickstart.yaml").optim.lr
    return 5e-5 * 10.0 * (2000 / SMOLLM2_WIDTH) ** 0.781


def quickstart_task():
    """The quickstart's task as polyrl builds it, with the SmolLM2 tokenizer."""
    from polyrl import load_config, load_tokenizer, make_task

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    tokenizer = load_tokenizer(cfg.model.name)
    return cfg, make_task(cfg.tasks[0], cfg.train.seed, cfg.model.system_prompt, tokenizer), tokenizer


# --- the cookbook run -------------------------------------------------------------------------------------------

def dataset_builder(model_dir: str, steps: int):
    """A cookbook ``RLDatasetBuilder`` over the quickstart's chain_sum items (training stream only)."""
    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
    from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    cfg, task, tokenizer = quickstart_task()
    # The chat template's default system message, as polyrl renders the prompt with it.
    system = [{"role": "system", "content": _template_system(tokenizer)}]

    class ChainSumEnv(ProblemEnv):
        def __init__(self, item, renderer):
            super().__init__(renderer, convo_prefix=system)
            self.item = item

        def get_question(self) -> str:
            return task.messages(self.item)[-1]["content"]

        def check_answer(self, sample_str: str) -> bool:
            return task.score(self.item, sample_str) >= 1.0

        def check_format(self, sample_str: str) -> bool:
            return True

        def get_reference_answer(self) -> str:
            return str(self.item["answer"])

    class ChainSumDataset(RLDataset):
        def __init__(self, renderer):
            self.renderer = renderer

        def get_batch(self, index: int):
            items = [task.train_item(index * GROUPS + g) for g in range(GROUPS)]
            return [ProblemGroupBuilder(env_thunk=partial(ChainSumEnv, item, self.renderer), num_envs=GROUP_SIZE,
                                        dataset_name="chain_sum") for item in items]

        def __len__(self) -> int:
            return steps

    @chz.chz
    class ChainSumBuilder(RLDatasetBuilder):
        async def __call__(self):
            renderer = renderers.get_renderer("qwen3_instruct", tokenizer=get_tokenizer(model_dir))
            _check_prompt_tokens(renderer, task, tokenizer, system)
            return ChainSumDataset(renderer), None

    return ChainSumBuilder()


def _template_system(tokenizer) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    start = "<|im_start|>system\n"
    if not text.startswith(start):
        raise SystemExit("the chat template adds no system message; this benchmark expects SmolLM2's")
    return text[len(start):text.index("<|im_end|>")]


def _check_prompt_tokens(renderer, task, tokenizer, system) -> None:
    """The cookbook renders the first training prompt to the same tokens polyrl's rollout would."""
    item = task.train_item(0)
    text = tokenizer.apply_chat_template(task.messages(item), add_generation_prompt=True, tokenize=False)
    ours = tokenizer(text, add_special_tokens=False).input_ids
    question = task.messages(item)[-1]["content"]
    theirs = renderer.build_generation_prompt(system + [{"role": "user", "content": question}])
    if theirs.to_ints() != list(ours):
        raise SystemExit(f"prompt tokens differ:\n  cookbook {theirs.to_ints()}\n  polyrl   {list(ours)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/api/v1/healthz", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def run_cookbook(args: argparse.Namespace) -> None:
    try:
        from tinker_cookbook.rl import train
    except ImportError as exc:
        raise SystemExit(f"tinker_cookbook is not importable ({exc}); see this file's docstring") from None
    from polyrl import resolve_model_path

    out = Path(args.work) / f"cookbook-{args.lr}"
    out.mkdir(parents=True, exist_ok=True)
    lr = learning_rate(args.lr)
    model_dir = str(resolve_model_path(MODEL).resolve())
    port = free_port()
    # What `polyrl serve MODEL --tinker` runs, with the server's per-call timings logged.
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(port), "--work", str(out)],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_for(base_url, server)
            os.environ["TINKER_API_KEY"] = "tml-local"
            config = train.Config(
                learning_rate=lr, dataset_builder=dataset_builder(model_dir, args.steps),
                model_name=model_dir, recipe_name="recipe_math_rl", renderer_name="qwen3_instruct",
                lora_rank=LORA_RANK, max_tokens=64, temperature=1.0, log_path=str(out / "log"),
                base_url=base_url, eval_every=0, save_every=args.every, loss_fn="importance_sampling",
                max_steps=args.steps)
            start = time.time()
            asyncio.run(train.main(config))
            wall = time.time() - start
        finally:
            server.terminate()
            server.wait(timeout=60)
    (out / "run.json").write_text(json.dumps({"lr_rule": args.lr, "learning_rate": lr, "steps": args.steps,
                                              "every": args.every, "wall_s": wall, "lora_rank": LORA_RANK,
                                              "server_seconds": server_times(out / "server.log")}))
    print(f"cookbook run ({args.lr}, lr {lr:.2e}): {args.steps} steps in {wall:.0f} s")


def run_server(args: argparse.Namespace) -> None:
    import logging

    from polyrl import serve_tinker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve_tinker(MODEL, args.port, 512, "auto", Path(args.work) / "server")


def server_times(log: Path) -> dict[str, dict[str, float]]:
    """Seconds the server spent per kind of call (its worker's log), and how many calls."""
    totals: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        if " polyrl.tinker " not in line or not line.endswith(" s"):
            continue
        name, _, rest = line.split(" polyrl.tinker ", 1)[1].partition(":")
        entry = totals.setdefault(name, {"calls": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["seconds"] = round(entry["seconds"] + float(rest.rsplit(":", 1)[-1].split()[0]), 2)
    return totals


# --- the native run ----------------------------------------------------------------------------------------------

def run_native(args: argparse.Namespace) -> None:
    out = Path(args.work) / "native"
    overrides = [f"train.steps={args.steps}", f"train.checkpoint_every={args.every}", "train.keep_checkpoints=100",
                 "train.max_minutes=null", "eval.before=false", "eval.after=false"]
    start = time.time()
    subprocess.run([sys.executable, "-m", "polyrl", "train", str(ROOT / "configs" / "quickstart.yaml"), *overrides,
                    "-o", str(out)], check=True)
    wall = time.time() - start
    (out / "run.json").write_text(json.dumps({"steps": args.steps, "every": args.every, "wall_s": wall,
                                              "overrides": overrides}))
    print(f"native run: {args.steps} steps in {wall:.0f} s")


# --- evaluation ---------------------------------------------------------------------------------------------------

def evaluate_policy(load, task, cfg, tokenizer, cache: Path, key: str) -> float:
    """Held-out accuracy of the model ``load()`` builds, remembered in ``cache`` under ``key``: the eval part
    can be run in pieces (each point takes a minute or more on a busy machine)."""
    from polyrl import HFEngine, evaluate

    done = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in done:
        engine = HFEngine(load().eval(), tokenizer, bf16=False)
        done[key] = evaluate(engine, task, cfg.tasks[0].eval_size, cfg.rollout.max_new_tokens)["accuracy"]
        cache.write_text(json.dumps(done, indent=1))
    return done[key]


def run_eval(args: argparse.Namespace) -> None:
    import torch

    from polyrl import list_checkpoints, load_model

    torch.manual_seed(0)
    work = Path(args.work)
    cfg, task, tokenizer = quickstart_task()
    start = time.time()
    cache = work / "heldout.json"
    base = evaluate_policy(lambda: load_model(MODEL), task, cfg, tokenizer, cache, "base")
    runs = []
    for out in sorted(work.glob("cookbook-*")):
        run = json.loads((out / "run.json").read_text())
        curve = {0: base, **cookbook_curve(out, run["steps"], task, cfg, tokenizer, cache, args.points)}
        metrics = _cookbook_metrics(out / "log" / "metrics.jsonl")
        runs.append({
            "what": "tinker_cookbook 0.6.1 rl.train.main through polyrl serve --tinker: LoRA rank "
                    f"{run['lora_rank']}, importance_sampling, lr {run['learning_rate']:.2e} ({run['lr_rule']})",
            "lr_rule": run["lr_rule"], "learning_rate": run["learning_rate"],
            "steps": run["steps"], "wall_s": round(run["wall_s"], 1),
            "heldout_curve": {str(k): v for k, v in sorted(curve.items())},
            "train_correct": metrics.get("env/all/correct"),
            "response_tokens": metrics.get("env/all/ac_tokens_per_turn"),
            "server_seconds": run["server_seconds"],
        })
    native_run = json.loads((work / "native" / "run.json").read_text())
    native_curve = {0: base}
    for ckpt in list_checkpoints(work / "native"):
        step = int(ckpt.name.split("-")[1])
        if args.points and step not in args.points:
            continue
        native_curve[step] = evaluate_policy(
            lambda ckpt=ckpt: load_model(str(ckpt)), task, cfg, tokenizer, cache, str(ckpt.relative_to(work)))
    result = {
        "machine": {**machine(), "note": args.note},
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "task": "reasoning-gym chain_sum as configs/quickstart.yaml (2 terms, 1 digit); held-out accuracy: "
                f"greedy, float32, the quickstart's {cfg.tasks[0].eval_size} held-out items",
        "heldout_items": cfg.tasks[0].eval_size,
        "samples_per_step": GROUPS * GROUP_SIZE,
        "cookbook": runs,
        "native": {
            "what": "polyrl train configs/quickstart.yaml (full fine-tuning) with " + " ".join(native_run["overrides"]),
            "steps": native_run["steps"], "wall_s": round(native_run["wall_s"], 1),
            "heldout_curve": {str(k): v for k, v in sorted(native_curve.items())},
        },
        "eval_s": round(time.time() - start, 1),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    write_table()
    print(json.dumps(result, indent=1))


def write_table(_: argparse.Namespace | None = None) -> None:
    """The held-out curves and wall times of the results file, as docs/tinker.md's one results table."""
    result = json.loads(RESULTS.read_text())
    runs = [("polyrl train (native, full fine-tuning)", result["native"])]
    runs += [(f"cookbook via --tinker, LoRA {r['lr_rule']} lr {r['learning_rate']:.1e}", r)
             for r in result["cookbook"]]
    steps = sorted({int(s) for _, r in runs for s in r["heldout_curve"]})
    m = result["machine"]
    note = f" ({m['note']})" if m.get("note") else ""
    lines = [f"{result['measured_at']}; {m['cpu_model']}, {m['cores']} cores{note}. Held-out accuracy (greedy, "
             f"the quickstart's {result['heldout_items']} items) after each number of steps of "
             f"{result['samples_per_step']} samples.",
             "", "| run | " + " | ".join(f"step {s}" for s in steps) + " | wall time |",
             "| --- | " + " | ".join("---" for _ in steps) + " | --- |"]
    for name, r in runs:
        curve = r["heldout_curve"]
        cells = [f"{100 * curve[str(s)]:.1f} %" if str(s) in curve else "" for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['wall_s'] / 60:.1f} min |")
    replace_block(DOC, "<!-- cookbook-rl:start -->", "<!-- cookbook-rl:end -->", "\n".join(lines),
                  "A cookbook recipe on this CPU")


def cookbook_curve(out: Path, steps: int, task, cfg, tokenizer, cache: Path,
                   points: list[int] | None) -> dict[int, float]:
    """Held-out accuracy of each sampler checkpoint the cookbook's loop saved, read from the server's disk."""
    from polyrl import tinker_sampler_policy

    curve = {}
    for line in (out / "log" / "checkpoints.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "sampler_path" not in record:
            continue
        model_id, kind, name = record["sampler_path"].removeprefix("tinker://").split("/")
        path = out / "server" / model_id / kind / name
        step = steps if name == "final" else int(name)
        if (points and step not in points) or step in curve:
            continue
        curve[step] = evaluate_policy(
            lambda path=path: tinker_sampler_policy(path), task, cfg, tokenizer, cache,
            str(path.relative_to(out.parent)))
    return curve


def _cookbook_metrics(path: Path) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {}
    if not path.exists():
        return series
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
                series.setdefault(key, []).append(round(float(value), 4))
    return series


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["cookbook", "native", "eval", "serve", "table"])
    p.add_argument("--port", type=int, default=0, help="serve: the port (the cookbook part picks one)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="checkpoint (and held-out point) every N steps")
    p.add_argument("--points", type=lambda text: [int(x) for x in text.split(",")], default=None,
                   help="eval: the steps to score (default: every checkpoint)")
    p.add_argument("--lr", choices=["lora-rule", "cookbook-formula"], default="lora-rule",
                   help="the cookbook run's learning rate (module docstring)")
    p.add_argument("--work", default="/tmp/polyrl-tinker-cookbook", help="where runs and checkpoints go")
    p.add_argument("--note", default="", help="eval: how the machine was shared while the runs ran (kept with the "
                                              "results: wall times taken under load are not idle ones)")
    args = p.parse_args()
    parts = {"cookbook": run_cookbook, "native": run_native, "eval": run_eval, "serve": run_server,
             "table": write_table}
    parts[args.part](args)


if __name__ == "__main__":
    main()
