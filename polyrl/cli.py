"""Command line: ``polyrl train | eval | data | serve | report | view | tasks``.

Each command imports what it runs inside its function: torch, transformers and pydantic take from a fraction of
a second to seconds to import, and ``polyrl --help`` needs none of them. Only ``__main__.py`` imports this
module, so no cycle can pass through these imports (tests/test_import_graph.py)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from polyrl.config import Config

BF16_HELP = "Sample in bf16 or float32 (default: bf16 where the CPU computes it natively)."
app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training for language models.")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command(context_settings={"allow_extra_args": False})
def train(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. optim.lr=2e-5.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Run directory (default runs/<name>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest checkpoint in the run dir.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Validate, print the resolved config and time per step; exit."),
    ] = False,
) -> None:
    """Train a policy with RL as the config says; evaluate held-out before and after."""
    from polyrl.config import ConfigError
    from polyrl.config_check import check_machine, load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as exc:
        _fail(str(exc))
    if dry_run:
        _dry_run(cfg, config)
        return
    from polyrl.placement import PlacementError
    from polyrl.waits import WaitTimeoutError

    try:
        check_machine(cfg)  # before any model loads: what this machine cannot run ends here, in one line
    except (ValueError, PlacementError, WaitTimeoutError) as exc:
        _fail(f"{config}: {exc}")
    run_dir = output or Path("runs") / cfg.name
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from polyrl.models.loading import ModelNotFoundError
    from polyrl.run.loop import train as run_training
    from polyrl.train.step import NonFiniteError

    def log(msg: str) -> None:
        typer.echo(msg, err=True)

    from polyrl.checkpoint.store import CheckpointError
    from polyrl.observe.metrics import SinkError
    from polyrl.parallel.group import RankFailedError

    # A run that cannot go on for a reason outside the code says why in one line; anything else is a bug and
    # keeps its traceback.
    run_errors = (ModelNotFoundError, ValueError, NonFiniteError, SinkError, RankFailedError, CheckpointError,
                  PlacementError, WaitTimeoutError)

    if cfg.stages:  # a pipeline: every stage is a run under RUN_DIR/stages/
        from polyrl.run.pipeline import run_pipeline

        try:
            run_pipeline(cfg, run_dir, resume=resume, log=log)
        except run_errors as exc:
            _fail(str(exc))
        typer.echo((run_dir / "stages.md").read_text())
        typer.echo(f"stages: {run_dir / 'stages.json'}  registry: {run_dir / 'registry.json'}")
        return
    try:
        summary = run_training(cfg, run_dir, resume=resume, log=log)
    except run_errors as exc:
        _fail(str(exc))
    _print_summary(summary, run_dir)
    if cfg.logging.report and (run_dir / "report.html").exists():
        typer.echo(f"report: {run_dir / 'report.html'}  (browse rollouts: polyrl view {run_dir})")


def _dry_run(cfg: Config, config_path: Path) -> None:
    from polyrl.config import dump_config
    from polyrl.models.device import engine_bf16, model_bf16
    from polyrl.models.loading import ModelNotFoundError
    from polyrl.run.estimate import estimate_step

    typer.echo(f"# {config_path}: valid. Resolved config:")
    typer.echo(dump_config(cfg))
    kind = {True: "bf16", False: "float32"}
    sampling = ("int8 weights (engine.int8_weights: true)" if cfg.engine.int8_weights else
                f"{kind[engine_bf16(cfg)]} (engine.bf16_weights: {str(cfg.engine.bf16_weights).lower()})")
    typer.echo(f"# Precision on this machine: training {kind[model_bf16(cfg)]} (model.bf16: "
               f"{str(cfg.model.bf16).lower()}), sampling {sampling}")
    typer.echo("# Estimated time per step on this machine (measured now, on the configured model):")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        estimate = estimate_step(cfg)
    except (ModelNotFoundError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(estimate.describe(cfg.train.steps))
    turns = max((getattr(t, "max_turns", None) or 1) for t in cfg.tasks)
    if turns > 1:
        typer.echo(f"note: the rollout estimate is for one model turn; tasks allowing up to {turns} turns "
                   "can take up to that many times longer to roll out.")
    typer.echo("# dry run: nothing was trained or written.")


def _print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out accuracy ({run_dir})")
    for col in ("task", "before", "after", "gain"):
        table.add_column(col)
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    for task in sorted(set(before) | set(after)):
        b, a = before.get(task), after.get(task)
        gain = f"{(a - b) * 100:+.1f} pts" if a is not None and b is not None else "-"
        table.add_row(task, _pct(b), _pct(a), gain)
    console = Console()
    console.print(table)
    console.print(
        f"{summary['steps']} steps, training {summary['train_time_s'] / 60:.1f} min, "
        f"wall {summary['wall_time_s'] / 60:.1f} min"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Option("--model", help="Model alias or HF directory (a checkpoint works).")],
    task: Annotated[str, typer.Option("--task", help="Task name (`polyrl tasks` lists them).")],
    n: Annotated[int, typer.Option("--n", help="Number of held-out items.")] = 200,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the held-out split.")] = 0,
    params: Annotated[str, typer.Option("--params", help="Task params as JSON.")] = "{}",
    prompt_suffix: Annotated[str, typer.Option("--prompt-suffix")] = "",
    answer: Annotated[str, typer.Option("--answer", help="last_number or full.")] = "last_number",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    env: Annotated[str | None, typer.Option("--env", help="Environment (default: from the task name).")] = None,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=BF16_HELP)] = None,
) -> None:
    """Greedy held-out accuracy of a model on a task; prints a JSON object."""
    from pydantic import ValidationError

    from polyrl.config import TaskConfig
    from polyrl.engines.hf import HFEngine
    from polyrl.envs.base import make_task
    from polyrl.models.device import resolve_bf16
    from polyrl.models.loading import ModelNotFoundError, load_model, load_tokenizer
    from polyrl.rollout.multi_turn import evaluate

    try:
        task_cfg = TaskConfig(
            name=task, env=env, params=json.loads(params), prompt_suffix=prompt_suffix, answer=answer, eval_size=n
        )
        tokenizer = load_tokenizer(model)
        env_task = make_task(task_cfg, seed, tokenizer=tokenizer)
        engine = HFEngine(load_model(model), tokenizer, bf16=resolve_bf16("auto" if bf16 is None else bf16, "cpu"))
    except (ModelNotFoundError, ValueError, ValidationError) as exc:
        _fail(str(exc).splitlines()[0])
    result = evaluate(engine, env_task, n, max_new_tokens)
    typer.echo(json.dumps({"model": model, "task": task, "seed": seed, **result}))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds metrics.jsonl).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Default RUN_DIR/report.html.")
    ] = None,
) -> None:
    """Write a self-contained HTML report of a run: curves, held-out eval, samples, config."""
    from polyrl.observe.report import ReportError, write_report

    try:
        path = write_report(run_dir, output)
    except (ReportError, OSError) as exc:
        _fail(str(exc))
    typer.echo(str(path))


@app.command()
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds trajectories.jsonl).")],
    port: Annotated[int, typer.Option("--port", help="Port (0 picks a free one).")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Loopback address to bind.")] = "127.0.0.1",
) -> None:
    """Browse a run's stored rollouts in a local web page (tokens, log-probs, loss mask, groups)."""
    from polyrl.observe.viewer import ViewerError, serve

    try:
        serve(run_dir, host, port, echo=typer.echo)
    except ViewerError as exc:
        _fail(str(exc))


@app.command()
def tasks() -> None:
    """List the available environments and reasoning-gym tasks, one line each."""
    from polyrl.observe.catalog import environments, reasoning_gym_tasks

    envs = environments()
    if envs:
        typer.echo("environments (tasks[].env):")
        width = max(len(n) for n, _ in envs)
        for name, doc in envs:
            typer.echo(f"  {name:<{width}}  {doc}")
        typer.echo("")
    rg = reasoning_gym_tasks()
    typer.echo("reasoning-gym tasks (tasks[].name):")
    width = max(len(n) for n, _ in rg)
    for name, doc in rg:
        typer.echo(f"  {name:<{width}}  {doc}")


@app.command("data")
def data_cmd(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. tasks.0.reward=x:y.")] = None,
) -> None:
    """Show what a run would train on: row counts, prompts as the model sees them, their lengths in tokens,
    held-out overlap, and the reward audit. Exits 1 when an audit fails."""
    from polyrl.config import ConfigError
    from polyrl.config_check import load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from polyrl.models.loading import ModelNotFoundError, load_tokenizer
    from polyrl.observe.data_report import describe_data

    try:
        passed = describe_data(cfg, load_tokenizer(cfg.model.name), typer.echo)
    except (ModelNotFoundError, ValueError) as exc:
        _fail(f"{config}: {exc}")
    if not passed:
        raise typer.Exit(1)


@app.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Argument(help="Model alias, HF directory, checkpoint, or run directory.")],
    port: Annotated[int, typer.Option("--port", help="Port on 127.0.0.1 (0 picks a free one).")] = 8000,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Default and cap of max_tokens (with --tinker: "
                                                                 "the default only).")] = 512,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=BF16_HELP)] = None,
    tinker: Annotated[bool, typer.Option("--tinker", help="Serve the Tinker training API instead "
                                                          "(docs/tinker.md).")] = False,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="With --tinker: where "
                                                        "checkpoints go (default: ~/.cache/polyrl/tinker).")] = None,
) -> None:
    """Serve a model as an OpenAI-compatible endpoint on 127.0.0.1 (chat/completions with tools), or with
    --tinker as the Tinker training API (forward_backward, optim_step, sampling, checkpoints)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from polyrl.models.loading import ModelNotFoundError

    if tinker:
        try:
            from polyrl.tinker_api.serve import serve as serve_tinker
        except ModuleNotFoundError as exc:  # the tinker package is an extra
            if (exc.name or "").split(".")[0] != "tinker":
                raise
            _fail("--tinker needs the tinker package: pip install 'polyrl[tinker]'")
        try:
            serve_tinker(model, port, max_tokens, "auto" if bf16 is None else bf16, checkpoint_dir, echo=typer.echo)
        except (ModelNotFoundError, ValueError, OSError) as exc:
            _fail(str(exc).splitlines()[0])
        return
    if checkpoint_dir is not None:
        _fail("--checkpoint-dir is an option of --tinker")
    from polyrl.endpoint.serve import serve

    try:
        serve(model, port, max_tokens, "auto" if bf16 is None else bf16, echo=typer.echo)
    except (ModelNotFoundError, ValueError, OSError) as exc:
        _fail(str(exc).splitlines()[0])


@app.command("export")
def export_cmd(
    source: Annotated[Path, typer.Argument(help="A run directory (its newest valid checkpoint) or a checkpoint.")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write; must not exist or be empty.")],
    base: Annotated[
        str | None, typer.Option("--base", help="Base model alias or HF directory (default: the checkpoint's).")
    ] = None,
    merge: Annotated[bool, typer.Option("--merge", help="LoRA: write merged weights, not the adapter.")] = False,
) -> None:
    """Write a checkpoint (sharded or not) as a Hugging Face directory: config, weights, tokenizer."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from polyrl.checkpoint.export import export_hf

    try:
        path = export_hf(source, out_dir, base, merge_lora=merge)
    except (ValueError, OSError) as exc:  # OSError: a missing model, a non-empty output directory
        _fail(str(exc))
    typer.echo(str(path))


@app.command("make-model")
def make_model(
    arch: Annotated[str, typer.Argument(help="llama3, qwen2, qwen3, gemma or gemma3.")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (config, safetensors, tokenizer).")],
    size: Annotated[str, typer.Option("--size", help="tiny (a few M parameters) or 1b (about 1B).")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    fp32: Annotated[bool, typer.Option("--fp32", help="Store 1b in float32 (4 GB) instead of bf16.")] = False,
) -> None:
    """Write a randomly initialised model of another architecture, usable as model.name (docs/models.md)."""
    import torch

    from polyrl.models.synthetic import parameter_count, write_random_model

    try:
        path = write_random_model(arch, out_dir, size, seed, torch.float32 if fp32 else None)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(f"{path}: {arch} {size}, {parameter_count(arch, size) / 1e6:.1f}M parameters")


def main() -> None:
    app(sys.argv[1:])
