"""``polyrl report RUN_DIR``: one self-contained HTML page (plots embedded as base64 PNG) built only from what
the run wrote: metrics.jsonl, summary.json, trajectories.jsonl and config.yaml.

Every section is optional except metrics.jsonl: a metric the run did not log is left out, not an error.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.observe.plots import eval_bar_plot, line_plot

# Per-step samples shown per task in the "rollouts" section.
EXAMPLES_PER_TASK = 3
MAX_EXAMPLE_CHARS = 600
SAMPLE_FLAGS = ("truncated", "terminated_early", "replayed", "guided", "hinted")
"""Trajectory flags counted per task and shown on examples (guided: a reference reply; hinted: sampled from a
prompt given the start of one; docs/guidance.md)."""


class ReportError(ValueError):
    """The run directory cannot be reported on; one line naming the file (and row)."""


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    config_text: str | None = None


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) per non-empty line; a bad row is a ReportError naming file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ReportError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ReportError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, row


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path}: not found (is {run_dir} a polyrl run directory?)")
    metrics = []
    for lineno, row in read_jsonl(metrics_path):
        if not isinstance(row.get("step"), int):
            raise ReportError(f"{metrics_path}:{lineno}: row has no integer 'step'")
        metrics.append(row)
    data = RunData(run_dir, metrics)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            data.summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise ReportError(f"{summary_path}: not valid JSON ({exc.msg})") from None
    traj_path = run_dir / "trajectories.jsonl"
    if traj_path.is_file():
        # Keep only what the report shows; token arrays are the viewer's business.
        keep = ("step", "task", "item_id", "group_id", "reward", "advantage", "text", *SAMPLE_FLAGS, "loss_mask")
        for _, row in read_jsonl(traj_path):
            sample = {k: row[k] for k in keep if k in row}
            sample["model_tokens"] = sum(sample.pop("loss_mask", []) or [])
            info = row.get("info") if isinstance(row.get("info"), dict) else {}
            if isinstance(info.get("monitor_flags"), list):
                sample["monitor_flags"] = [str(f) for f in info["monitor_flags"]]
            data.samples.append(sample)
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        data.config_text = config_path.read_text()
    return data


# ---------------------------------------------------------------------------------------------- plots


@dataclass
class Panel:
    title: str
    ylabel: str
    match: Callable[[str], bool]


# Named panels in display order; every numeric metric no panel claims is plotted under "Other metrics".
PANELS = [
    Panel("Reward per task", "mean reward", lambda k: k.startswith("reward/")),
    Panel("KL to reference", "KL", lambda k: k == "kl" or k.startswith("kl/")),
    Panel("Entropy", "nats / token", lambda k: k == "entropy" or k.startswith("entropy/")),
    Panel("Response length", "tokens", lambda k: k.startswith("response_length")),
    Panel("Clip fraction", "fraction of tokens", lambda k: "clip_frac" in k),
    Panel("Staleness", "policy versions", lambda k: k.startswith("staleness")),
    # engine vs learner log-probs of the sampled tokens (polyrl/algorithms/mismatch.py), logged every step
    Panel("Engine/learner mismatch", "log-ratio, KL, fraction", lambda k: k.startswith("mismatch/")),
    Panel("Throughput", "tokens / s", lambda k: k.endswith("tokens_per_s")),
    Panel("Step time", "seconds", lambda k: k in ("step_time_s", "rollout_time_s", "update_time_s")
          or k.startswith("time/")),
    Panel("Loss", "loss", lambda k: k == "loss" or k.startswith("loss/")),
    Panel("Reward-hacking monitors", "share of rewarded samples",
          lambda k: k.startswith("monitor/") and k != "monitor/zeroed"),
]


def numeric_series(metrics: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values), keeping only finite numbers (null, NaN and text are skipped)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in metrics:
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(row["step"])
            values.append(float(value))
    return series


# ----------------------------------------------------------------------------------------------- html

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1d2433;background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dce3}
.meta{color:#5b6475;font-size:13px}
.grid{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
figure{margin:0;background:#fff;border:1px solid #e1e4ea;border-radius:6px;padding:6px}
figure img{display:block;max-width:100%}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border:1px solid #e1e4ea;padding:4px 10px;text-align:left;vertical-align:top}
th{background:#eef0f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pos{color:#137333}.neg{color:#b3261e}.best{font-weight:700}
pre{background:#fff;border:1px solid #e1e4ea;padding:10px;overflow:auto;font-size:12px}
td.text{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;max-width:640px}
.flag{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;background:#fde7c8;margin-right:3px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return _e(x)


def _pct(x: Any) -> str:
    return f"{x * 100:.1f}%" if isinstance(x, int | float) else "-"


def _img(b64: str, alt: str) -> str:
    return f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{b64}"></figure>'


def eval_section(summary: dict[str, Any]) -> str:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if not isinstance(before, dict) or not isinstance(after, dict) or not (before or after):
        return ""
    rows = []
    for task in sorted(set(before) | set(after)):
        b, a = before.get(task), after.get(task)
        gain = "-"
        if isinstance(a, int | float) and isinstance(b, int | float):
            cls = "pos" if a > b else "neg" if a < b else ""
            gain = f'<span class="{cls}">{(a - b) * 100:+.1f} pts</span>'
        rows.append(f"<tr><td>{_e(task)}</td><td class=num>{_pct(b)}</td><td class=num>{_pct(a)}</td>"
                    f"<td class=num>{gain}</td></tr>")
    table = ("<table id=eval-table><tr><th>task</th><th>before</th><th>after</th><th>gain</th></tr>"
             + "".join(rows) + "</table>")
    numeric = {k: v for k, v in before.items() if isinstance(v, int | float)}
    numeric_after = {k: v for k, v in after.items() if isinstance(v, int | float)}
    plot = ""
    if numeric or numeric_after:
        plot = _img(eval_bar_plot(numeric, numeric_after), "held-out evaluation")
    return f"<h2>Held-out evaluation</h2><div class=grid>{table}{plot}</div>"


def stage_table(stages: Any) -> dict[str, dict[str, float]]:
    """Normalise ``summary["stages"]`` to {stage: {domain: score}}, in stage order.

    Accepted shapes: ``{stage: {domain: score}}`` or ``[{"name": stage, "eval": {domain: score}}, ...]``
    (``stage``/``scores`` are accepted for ``name``/``eval``). Anything else yields an empty table.
    """
    out: dict[str, dict[str, float]] = {}
    if isinstance(stages, dict):
        items = list(stages.items())
    elif isinstance(stages, list):
        items = []
        for i, entry in enumerate(stages):
            if isinstance(entry, dict):
                name = entry.get("name", entry.get("stage", f"stage {i + 1}"))
                items.append((str(name), entry.get("eval", entry.get("scores"))))
    else:
        return out
    for name, scores in items:
        if isinstance(scores, dict):
            out[str(name)] = {str(d): float(v) for d, v in scores.items() if isinstance(v, int | float)}
    return out


def stages_section(summary: dict[str, Any]) -> str:
    table = stage_table(summary.get("stages"))
    if not table:
        return ""
    stages = list(table)
    domains = sorted({d for scores in table.values() for d in scores})
    head = "".join(f"<th>{_e(s)}</th>" for s in stages)
    rows = []
    for d in domains:
        scores = [table[s].get(d) for s in stages]
        best = max((x for x in scores if x is not None), default=None)
        cells = "".join(
            "<td class=num>-</td>" if x is None else
            f'<td class="num{" best" if x == best else ""}">{_pct(x)}</td>' for x in scores
        )
        rows.append(f"<tr><td>{_e(d)}</td>{cells}</tr>")
    return ("<h2>Held-out score per domain and stage</h2><table id=stages-table><tr><th>domain</th>"
            f"{head}</tr>{''.join(rows)}</table><p class=meta>Bold: best stage for the domain.</p>")


def plots_section(metrics: list[dict[str, Any]]) -> str:
    series = numeric_series(metrics)
    claimed: set[str] = set()
    figures = []
    for panel in PANELS:
        keys = [k for k in series if k not in claimed and panel.match(k)]
        claimed.update(keys)
        if keys:
            png = line_plot(panel.title, panel.ylabel, {k: series[k] for k in keys})
            figures.append(_img(png, panel.title))
    # Whatever else was logged, grouped by its prefix ("ratio/a", "ratio/b" share a plot).
    groups: dict[str, list[str]] = {}
    for key in series:
        if key not in claimed:
            groups.setdefault(key.split("/")[0], []).append(key)
    others = [
        _img(line_plot(name, name, {k: series[k] for k in keys}), name)
        for name, keys in sorted(groups.items())
    ]
    out = f"<h2>Training curves</h2><div class=grid id=curves>{''.join(figures)}</div>"
    if others:
        out += f"<h2>Other metrics</h2><div class=grid id=other-curves>{''.join(others)}</div>"
    return out


def monitors_section(metrics: list[dict[str, Any]]) -> str:
    """The reward-hacking monitors (polyrl/rewards/monitors.py) over the run: per flag, the mean and the last
    step's share of rewarded samples that carry it, and the steps where any did; samples zeroed in all."""
    keys = sorted({k for row in metrics for k in row if k.startswith("monitor/") and k != "monitor/zeroed"})
    if not keys:
        return ""
    rows = []
    for key in keys:
        values = [(row["step"], row[key]) for row in metrics if isinstance(row.get(key), int | float)]
        if not values:
            continue
        hit = [step for step, v in values if v > 0]
        rows.append(f"<tr><td>{_e(key)}</td><td class=num>{_pct(sum(v for _, v in values) / len(values))}</td>"
                    f"<td class=num>{_pct(values[-1][1])}</td><td class=num>{len(hit)} of {len(values)}</td></tr>")
    zeroed = sum(float(row.get("monitor/zeroed") or 0) for row in metrics)
    return ("<h2>Reward-hacking monitors</h2><p class=meta>Share of the rewarded samples of monitored tasks "
            "(code, last-number answers) whose text shows each shortcut; filter them in <code>polyrl view</code>."
            f" Samples whose reward was zeroed (<code>monitors.zero_flagged</code>): {zeroed:.0f}.</p>"
            "<table id=monitors><tr><th>metric</th><th>mean over steps</th><th>last step</th>"
            "<th>steps with any</th></tr>" + "".join(rows) + "</table>")


def samples_section(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return ""
    steps = sorted({s.get("step", 0) for s in samples})
    tasks = sorted({str(s.get("task", "?")) for s in samples})
    stat_rows = []
    for task in tasks:
        mine = [s for s in samples if str(s.get("task", "?")) == task]
        flags = SAMPLE_FLAGS
        rates = "".join(
            f"<td class=num>{_pct(sum(bool(s.get(f)) for s in mine) / len(mine))}</td>" for f in flags
        )
        mean_r = sum(float(s.get("reward", 0.0)) for s in mine) / len(mine)
        stat_rows.append(
            f"<tr><td>{_e(task)}</td><td class=num>{len(mine)}</td>"
            f"<td class=num>{mean_r:.3f}</td>{rates}</tr>"
        )
    heads = "".join(f"<th>{f.replace('_', ' ')}</th>" for f in SAMPLE_FLAGS)
    stats = ("<table id=sample-stats><tr><th>task</th><th>stored</th><th>mean reward</th>" + heads + "</tr>"
             + "".join(stat_rows) + "</table>")
    # The best and worst stored samples of the last step show what the policy does now.
    last = [s for s in samples if s.get("step", 0) == steps[-1]]
    example_rows = []
    for task in tasks:
        mine = sorted((s for s in last if str(s.get("task", "?")) == task),
                      key=lambda s: float(s.get("reward", 0.0)), reverse=True)
        picks = mine[:EXAMPLES_PER_TASK - 1] + mine[-1:] if len(mine) > EXAMPLES_PER_TASK else mine
        for s in picks:
            text = str(s.get("text", ""))
            if len(text) > MAX_EXAMPLE_CHARS:
                text = text[:MAX_EXAMPLE_CHARS] + " …"
            flags = "".join(f"<span class=flag>{_e(f.replace('_', ' '))}</span>"
                            for f in [*(f for f in SAMPLE_FLAGS if s.get(f)),
                                      *s.get("monitor_flags", [])])
            example_rows.append(
                f"<tr><td>{_e(task)}</td><td class=num>{_fmt(s.get('item_id', '-'))}</td>"
                f"<td class=num>{_fmt(float(s.get('reward', 0.0)))}</td>"
                f"<td class=num>{_fmt(float(s.get('advantage', 0.0)))}</td>"
                f"<td class=num>{_fmt(s.get('model_tokens', '-'))}</td>"
                f"<td class=text>{flags}{_e(text)}</td></tr>"
            )
    examples = ("<table id=examples><tr><th>task</th><th>item</th><th>reward</th><th>advantage</th>"
                "<th>tokens</th><th>reply</th></tr>" + "".join(example_rows) + "</table>")
    return (f"<h2>Stored rollouts</h2><p class=meta>{len(samples)} trajectories over {len(steps)} steps in "
            "trajectories.jsonl (browse them with <code>polyrl view RUN_DIR</code>).</p>"
            f"{stats}<h2>Samples at step {steps[-1]} (best and worst reward)</h2>{examples}")


def summary_facts(data: RunData) -> str:
    s, facts = data.summary, []
    steps = s.get("steps", data.metrics[-1]["step"] if data.metrics else 0)
    facts.append(f"{steps} steps")
    for key, label in (("train_time_s", "training"), ("wall_time_s", "wall")):
        if isinstance(s.get(key), int | float):
            facts.append(f"{label} {s[key] / 60:.1f} min")
    skipped = {"eval_before", "eval_after", "gain", "stages", "steps", "train_time_s", "wall_time_s"}
    for key, value in s.items():
        if key not in skipped and isinstance(value, str | int | float | bool):
            facts.append(f"{_e(key)}: {_fmt(value)}")
    return " · ".join(facts)


def render(data: RunData) -> str:
    title = f"polyrl report: {data.run_dir.name}"
    parts = [
        f"<h1>{_e(title)}</h1><p class=meta>{_e(str(data.run_dir))} · {summary_facts(data)}</p>",
        eval_section(data.summary),
        stages_section(data.summary),
        plots_section(data.metrics) if data.metrics else "<p>metrics.jsonl has no steps yet.</p>",
        monitors_section(data.metrics),
        samples_section(data.samples),
    ]
    if data.config_text is not None:
        parts.append(f"<h2>Config</h2><pre id=config>{_e(data.config_text)}</pre>")
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(parts)}</main></body></html>")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Build RUN_DIR/report.html (or ``out``) from the run's files; returns its path."""
    run_dir = Path(run_dir)
    target = out or run_dir / "report.html"
    page = render(load_run(run_dir))
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text(page)
    tmp.replace(target)
    return target


def write_report_safely(run_dir: Path, log: Callable[[str], Any] = print) -> Path | None:
    """``write_report`` for the end of training: a report problem is a warning, never a lost run."""
    try:
        return write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's own files are already safe on disk
        text = str(exc).strip()
        log(f"warning: report.html not written: {text.splitlines()[0] if text else repr(exc)}")
        return None
