"""How one update's metrics add up over micro-batches, epochs and ranks: the loss parts are summed (the
micro-batches' losses add up to the batch loss), other metrics averaged (extremes for ``*/max``, ``*/min``),
the engine/learner mismatch summed and turned into its metrics at the end."""

from __future__ import annotations

from polyrl.algorithms.mismatch import mismatch_metrics
from polyrl.parallel.group import merge_rank_metrics
from polyrl.plan import Ranks


def add_sums(into: dict[str, float], sums: dict[str, float]) -> None:
    """Add sums into ``into``; ``*/max`` keys keep the largest."""
    for key, v in sums.items():
        into[key] = max(into.get(key, v), v) if key.endswith("/max") else into.get(key, 0.0) + v


def accumulate(into: dict[str, float], metrics: dict[str, float], n: int) -> None:
    """Average micro-batch metrics over ``n`` contributions; ``*/max`` and ``*/min`` take the extreme."""
    for key, v in metrics.items():
        if key.endswith("/max"):
            into[key] = max(into.get(key, v), v)
        elif key.endswith("/min"):
            into[key] = min(into.get(key, v), v)
        else:
            into[key] = into.get(key, 0.0) + v / n


class UpdateMetrics:
    """The metrics of one update of ``epochs`` optimizer steps."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs
        self.totals: dict[str, float] = {}  # summed over micro-batches, averaged over epochs
        self.means: dict[str, float] = {}  # averaged over micro-batches and epochs
        self.mismatch: dict[str, float] = {}  # engine vs learner log-probs, summed over this rank's micro-batches

    def add_pass(self, loss: float, logged: dict[str, float], metrics: dict[str, float], n: int) -> None:
        """One micro-batch's pass: its loss and logged loss parts, and its metrics as one of ``n``."""
        for key, v in {**logged, "loss": loss}.items():
            self.totals[key] = self.totals.get(key, 0.0) + v / self.epochs
        accumulate(self.means, metrics, n)

    def add_step(self, grad_norm: float, skipped: bool) -> None:
        if skipped:
            self.totals["skipped_updates"] = self.totals.get("skipped_updates", 0.0) + 1
        self.means["grad_norm"] = self.means.get("grad_norm", 0.0) + grad_norm / self.epochs

    def result(self, ranks: Ranks, task_metrics: dict[str, float], lr: float) -> dict[str, float | None]:
        """The update's metrics, merged over ``ranks`` when there are several."""
        totals = {**self.totals, **{f"mismatch/sum/{key}": v for key, v in self.mismatch.items()}}
        means = self.means
        if ranks.distributed:
            totals, means = merge_rank_metrics(ranks, totals, means)
        sums = {key.removeprefix("mismatch/sum/"): totals.pop(key) for key in list(totals)
                if key.startswith("mismatch/sum/")}
        totals.update(mismatch_metrics(sums))
        totals.update(task_metrics)  # already the same on every rank (dot products summed over the ranks)
        totals.setdefault("kl", None)  # not measured: no reference was kept (kl_coef 0, track_kl off)
        totals.setdefault("skipped_updates", 0.0)
        return {**totals, **means, "zero_gradient": 0.0, "lr": lr}
