"""A rich progress bar for training: step, reward, KL, tokens/s and ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  kl {task.fields[kl]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start, reward="-", kl="-", tps="-")

    def __enter__(self) -> TrainProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, metrics: dict) -> None:
        kl = metrics.get("kl")
        self.progress.update(
            self.task,
            completed=step,
            reward="-" if metrics["reward/mean"] is None else f"{metrics['reward/mean']:.3f}",
            kl="-" if kl is None else f"{kl:.4f}",
            tps=f"{metrics['tokens_per_s']:.0f}",
        )
