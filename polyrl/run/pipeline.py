"""Multi-stage pipelines (Cascade RL, Wang et al. 2025, "Nemotron-Cascade"): sft / rl / distill stages in order.

Each stage is an ordinary run in RUN_DIR/stages/<i>-<name>/ (the RL loop, or ``sft.train_sft``), starting from
the previous stage's final checkpoint. After every stage all tasks of the pipeline are evaluated held-out; the
domain x stage table goes to RUN_DIR/stages.md and stages.json, the best checkpoint per task to
RUN_DIR/registry.json. A task that falls more than ``pipeline.regression_threshold`` below its best is
reported, and with ``pipeline.on_regression: distill`` a distill stage is inserted that teaches it from its best
checkpoint (multi-teacher on-policy distillation, ``algorithms/distill.py``). A distill stage teaches every task,
those whose best is its own starting checkpoint included (retention: they are held where they are while the
others move), and is skipped when every task's teacher is its start. ``run/retention.py`` adds replay of
earlier domains with a KL to their best checkpoints in RL stages, RL stages that keep their best validated
part, and early stopping of distill stages.

stages.json is also the pipeline's state: the plan (with inserted stages) and the finished stages' results, so
``--resume`` skips finished stages and resumes the interrupted one from its own checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from polyrl.checkpoint.store import latest_checkpoint
from polyrl.config import Config, ConfigError, StageConfig, merge_algorithm
from polyrl.config_check import load_config
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import make_task
from polyrl.models.device import model_bf16, resolve_device
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.rollout.multi_turn import evaluate
from polyrl.rollout.policy_chat import EnginePolicy
from polyrl.run.loop import train
from polyrl.run.retention import distill_until_within, replay_weights, rl_keep_best, validation_config
from polyrl.run.sft import train_sft

STATE = "stages.json"
# Accuracies are fractions of item counts: 0.20 - 0.18 is a 2-point drop, not "more than 0.02".
FLOAT_SLACK = 1e-9


def evaluate_domains(config: Config, model_name: str) -> dict[str, float]:
    """Greedy held-out accuracy of ``model_name`` on every task of ``config`` (the same items every time)."""
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, None, seed=config.train.seed, device=resolve_device(config.train.device)).eval()
    if config.eval.bf16:
        engine = HFEngine(model, tokenizer, bf16=model_bf16(config), bf16_weights=True)
    else:  # as the RL loop: accuracy of the float32 weights themselves
        engine = HFEngine(model, tokenizer, bf16=False)
    max_new = config.eval.max_new_tokens or config.rollout.max_new_tokens
    # A self-play task's other seat is this model too, sampled as in training.
    policy = EnginePolicy(engine, config.rollout.max_new_tokens, config.rollout.temperature, config.rollout.top_p)
    out = {}
    for t in config.tasks:
        task = make_task(t, config.train.seed, config.model.system_prompt, tokenizer, policy)
        out[t.name] = evaluate(engine, task, t.eval_size, max_new, config.eval.batch_size)["accuracy"]
    return out


def registry(rows: list[dict[str, Any]], latest_on_tie: bool = False) -> dict[str, dict[str, Any]]:
    """Best row per task: {task: {stage, checkpoint, accuracy}}; the earliest stage wins a tie, or the latest
    with ``latest_on_tie`` (a taught stage's teachers: a task whose start scores its best is held there)."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        for task, acc in row["eval"].items():
            if task not in best or acc > best[task]["accuracy"] or (latest_on_tie and acc == best[task]["accuracy"]):
                best[task] = {"stage": row["label"], "checkpoint": row["checkpoint"], "accuracy": acc}
    return best


def find_regressions(
    earlier: list[dict[str, Any]], current: dict[str, float], threshold: float
) -> dict[str, dict[str, Any]]:
    """Tasks whose accuracy now is more than ``threshold`` below their best in ``earlier`` rows."""
    best = registry(earlier)
    return {
        task: {"best": best[task]["accuracy"], "best_stage": best[task]["stage"], "now": acc}
        for task, acc in current.items()
        if task in best and best[task]["accuracy"] - acc > threshold + FLOAT_SLACK
    }


def _same_model(a: str, b: str) -> bool:
    """Whether two model names (aliases or directories) name the same model."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()


def _teacher(label: str, task: str, best: dict[str, dict]) -> str:
    if task not in best:
        raise ConfigError(f"stage {label}: no registry entry for task '{task}' to teach it")
    return best[task]["checkpoint"]


def stage_config(
    base: Config, stage: StageConfig, label: str, model: str, best: dict[str, dict], others: list[str] = ()
) -> Config | None:
    """The plain single-run config of one stage: its tasks, overrides and teachers, starting from ``model``.

    An rl stage with ``replay`` also samples the tasks in ``others`` (those earlier stages trained, or all
    of the pipeline's: ``replay_from``) that are not its own, with ``retain_coef`` as the weight of the
    reverse KL to their best checkpoints.

    A distill stage teaches every task, including those whose teacher is ``model`` itself: alone, such a
    task's reverse KL is 0 and AdamW would normalise its near-zero gradients into full-size steps, but next to
    tasks with other teachers it holds the task where it is while the shared weights move. None when every
    task's teacher is ``model``, i.e. the stage has nothing to do.
    """
    data = base.model_dump(mode="json", exclude={"stages", "pipeline"})
    data["name"] = f"{base.name}-{label}"
    data["model"]["name"] = model
    own = [t for t in data["tasks"] if not stage.tasks or t["name"] in stage.tasks]
    replayed = [t for t in data["tasks"] if stage.replay and t["name"] in others and t not in own]
    weights = replay_weights({t["name"]: t["weight"] for t in own}, [t["name"] for t in replayed], stage.replay)
    data["tasks"] = [t for t in data["tasks"] if t in own or t in replayed]
    for t in replayed:
        t["teacher"] = _teacher(label, t["name"], best) if stage.retain_coef else None
    if replayed and stage.retain_coef:
        data["algorithm"]["regularisers"]["distill_coef"] = stage.retain_coef
    for t in own:
        spec = stage.teachers.get(t["name"]) or t["teacher"] or ("best" if stage.taught else None)
        t["teacher"] = (_teacher(label, t["name"], best) if spec == "best" else spec) if stage.taught else None
    for t in data["tasks"]:
        t["weight"] = weights[t["name"]]
    if stage.kind == "distill":
        if all(_same_model(t["teacher"], model) for t in data["tasks"]):
            return None
        # pure on-policy distillation unless the stage's algorithm says otherwise
        data["algorithm"]["loss"]["pg_coef"], data["algorithm"]["regularisers"]["distill_coef"] = 0.0, 1.0
    data["algorithm"] = merge_algorithm(data["algorithm"], stage.algorithm)
    data["rollout"].update(stage.rollout)
    if stage.lr is not None:
        data["optim"]["lr"] = stage.lr
    if stage.max_new_tokens is not None:
        data["rollout"]["max_new_tokens"] = stage.max_new_tokens
        shaping = data["algorithm"]["shaping"]
        shaping["overlong_buffer"] = min(shaping["overlong_buffer"], stage.max_new_tokens)
    data["train"]["steps"] = stage.steps
    data["eval"]["before"] = data["eval"]["after"] = False  # the pipeline evaluates every task itself
    return load_config(f"stage {label}", data=data)


def table_markdown(state: dict[str, Any], threshold: float) -> str:
    """The task x stage table (held-out accuracy, %), regressions marked, and each task's best."""
    rows, tasks = state["rows"], state["tasks"]
    best = registry(rows)
    head = "| task | " + " | ".join(r["label"] for r in rows) + " | best | final - best |"
    lines = [head, "|" + " --- |" * (len(rows) + 3)]
    for task in tasks:
        cells = []
        for r in rows:
            mark = " ↓" if task in r.get("regressions", {}) else ""
            cells.append(f"{r['eval'][task] * 100:.1f}{mark}")
        gap = (rows[-1]["eval"][task] - best[task]["accuracy"]) * 100
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {best[task]['accuracy'] * 100:.1f} "
                     f"({best[task]['stage']}) | {gap:+.1f} |")
    lines.append("")
    lines.append(f"↓: more than {threshold * 100:.1f} points below the task's best earlier stage.")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save(run_dir: Path, state: dict[str, Any], threshold: float) -> None:
    best = registry(state["rows"])
    final = state["rows"][-1]["eval"]
    state["final_gap"] = {t: final[t] - best[t]["accuracy"] for t in state["tasks"]}
    _write(run_dir / STATE, json.dumps(state, indent=2))
    _write(run_dir / "registry.json", json.dumps(best, indent=2))
    _write(run_dir / "stages.md", table_markdown(state, threshold))


def _label(index: int, entry: dict[str, Any]) -> str:
    return f"{index + 1}-{entry['stage']['name']}"


def _trained_before(state: dict[str, Any], index: int) -> list[str]:
    """Tasks that the sft / rl stages of the plan before ``index`` trained on."""
    names: list[str] = []
    for entry in state["plan"][:index]:
        stage = entry["stage"]
        if stage["kind"] in ("sft", "rl"):
            names += [t for t in stage["tasks"] or state["tasks"] if t not in names]
    return names


def run_pipeline(config: Config, run_dir: Path, resume: bool = False, log=print) -> dict[str, Any]:
    """Run ``config.stages`` in order into ``run_dir`` (or resume it); returns the state written to stages.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / STATE
    threshold = config.pipeline.regression_threshold
    if state_path.exists() and not resume:
        raise ValueError(f"{run_dir}: already holds a pipeline ({STATE}); pass --resume or another --output")
    if resume and state_path.exists():
        state = json.loads(state_path.read_text())
        log(f"resuming pipeline: {len(state['rows']) - 1} of {len(state['plan'])} stages done")
    else:
        state = {"tasks": [t.name for t in config.tasks], "rows": [],
                 "plan": [{"stage": s.model_dump(mode="json"), "inserted_after": None} for s in config.stages]}
    if not state["rows"]:  # the starting point is the first column of the table
        base_eval = evaluate_domains(config, config.model.name)
        state["rows"].append({"label": "base", "kind": "base", "checkpoint": config.model.name, "eval": base_eval})
        log(f"base: {json.dumps(base_eval)}")
        _save(run_dir, state, threshold)
    index = len(state["rows"]) - 1  # plan entries already done
    checked: dict[str, dict[str, float]] = {}
    checking = validation_config(config)

    def validate(model: str) -> dict[str, float]:
        """Validation accuracy of a checkpoint, each evaluated once."""
        if model not in checked:
            checked[model] = evaluate_domains(checking, model)
        return checked[model]

    while index < len(state["plan"]):
        entry = state["plan"][index]
        stage, label = StageConfig.model_validate(entry["stage"]), _label(index, entry)
        stage_dir = run_dir / "stages" / label
        start = state["rows"][-1]["checkpoint"]
        others = state["tasks"] if stage.replay_from == "all" else _trained_before(state, index)
        cfg = stage_config(config, stage, label, start, registry(state["rows"], latest_on_tie=stage.taught), others)
        extra: dict[str, Any] = {}
        if cfg is not None and stage.kind == "rl" and cfg.algorithm.regularisers.distill_coef > 0:
            extra["retain_teachers"] = {t.name: t.teacher for t in cfg.tasks if t.teacher}
        if cfg is not None and len(cfg.tasks) > 1:
            extra["mixture"] = {t.name: t.weight for t in cfg.tasks}
        if stage.taught:
            extra["teachers"] = {t.name: t.teacher for t in cfg.tasks} if cfg is not None else {}
            for task, teacher in extra["teachers"].items():
                own = "its own correct replies" if stage.kind == "sft" else "retained as it is"
                how = f"{own} (its best is the stage's start)" if _same_model(teacher, start) else \
                    f"taught by {teacher}"
                log(f"stage {label}: {task} {how}")
        t0 = time.perf_counter()
        if cfg is None:  # a distill stage with nothing to teach: no training step, the weights stay as they are
            log(f"stage {label}: skipped, every task's teacher is its starting checkpoint")
            ckpt, result, summary = start, dict(state["rows"][-1]["eval"]), {"steps": 0, "train_time_s": 0.0}
        else:
            log(f"stage {label} ({stage.kind}, {stage.steps} steps, tasks: {', '.join(t.name for t in cfg.tasks)})")
            run_stage = train_sft if stage.kind == "sft" else train
            if stage.taught and stage.until_within is not None:
                summary = distill_until_within(cfg, stage_dir, stage.steps, stage.eval_every, stage.until_within,
                                               validate, focus=stage.focus, run_part=run_stage, resume=resume,
                                               log=log)
                ckpt = summary["checkpoint"]
                extra["early_stop"] = {k: summary[k] for k in ("kept_part", "parts", "teacher_validation")}
            elif stage.keep_best:
                summary = rl_keep_best(cfg, stage_dir, stage.steps, stage.eval_every, validate, resume, log)
                ckpt = summary["checkpoint"]
                extra["kept_best"] = {k: summary[k] for k in ("kept_part", "parts")}
            else:
                summary = run_stage(cfg, stage_dir, resume=resume and stage_dir.exists(), log=log)
                ckpt = latest_checkpoint(stage_dir)
                if ckpt is None:
                    raise RuntimeError(f"stage {label}: finished without a checkpoint in {stage_dir}")
            result = evaluate_domains(config, str(ckpt))
        regressions = find_regressions(state["rows"], result, threshold)
        steps = summary.get("steps") or 0
        state["rows"].append({
            "label": label, "kind": stage.kind, "checkpoint": str(ckpt), "eval": result,
            "regressions": regressions, "steps": steps, "train_time_s": summary.get("train_time_s"),
            "samples": steps * cfg.rollout.prompts_per_step * cfg.rollout.group_size if cfg is not None else 0,
            "wall_s": time.perf_counter() - t0, **extra,
        })
        log(f"{label}: {json.dumps(result)}")
        for task, r in regressions.items():
            log(f"regression: {task} {r['now'] * 100:.1f}% after {label}, best {r['best'] * 100:.1f}% "
                f"({r['best_stage']})")
        if regressions and config.pipeline.on_regression == "distill" and entry["inserted_after"] is None:
            fix = StageConfig(name="recover", kind="distill", tasks=sorted(regressions),
                              steps=config.pipeline.regression_steps)
            state["plan"].insert(index + 1, {"stage": fix.model_dump(mode="json"), "inserted_after": label})
            log(f"inserted stage {_label(index + 1, state['plan'][index + 1])}: distill {', '.join(fix.tasks)} "
                "from their best checkpoints")
        _save(run_dir, state, threshold)
        index += 1
    return state
