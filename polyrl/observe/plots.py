"""Plots for the HTML report: matplotlib figures rendered to base64 PNG, without pyplot's global state."""

from __future__ import annotations

import base64
import io


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float = 5.6, height: float = 3.0):
    # Figure + Agg canvas directly, not pyplot: no global backend switch, safe inside any host program.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def line_plot(title: str, ylabel: str, lines: dict[str, tuple[list[int], list[float]]]) -> str:
    """A PNG (base64) of one or more metric curves over steps; long noisy curves get a moving average."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, (label, (steps, values)) in enumerate(sorted(lines.items())):
        color = f"C{i % 10}"
        marker = "o" if len(steps) < 30 else None
        if len(values) >= 20:
            window = max(2, len(values) // 20)
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
            ax.plot(steps, _moving_average(values, window), color=color, label=f"{label} (avg {window})")
        else:
            ax.plot(steps, values, color=color, marker=marker, markersize=3, label=label)
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # Plain tick labels: an offset like "1e-5 + 10.79" hides the actual level of a flat curve.
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def eval_bar_plot(before: dict[str, float], after: dict[str, float]) -> str:
    tasks = sorted(set(before) | set(after))
    fig = _figure(max(4.0, 1.2 * len(tasks) + 2), 3.0)
    ax = fig.add_subplot()
    xs = range(len(tasks))
    ax.bar([x - 0.2 for x in xs], [before.get(t, 0.0) for t in tasks], 0.4, label="before", color="C7")
    ax.bar([x + 0.2 for x in xs], [after.get(t, 0.0) for t in tasks], 0.4, label="after", color="C0")
    ax.set_xticks(list(xs), tasks, rotation=20 if len(tasks) > 3 else 0, fontsize=8)
    ax.set_ylabel("held-out score")
    ax.set_ylim(0, max([1.0, *before.values(), *after.values()]) * 1.05)
    ax.set_title("Held-out evaluation", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)
