"""Task sampler: draws (task, item) pairs from a weighted mixture; its whole state is a dict of cursors.

Task choice at step s uses a generator seeded from (seed, s), so a resumed run draws exactly what an
uninterrupted one would, and each task's items are read in order from its own procedural stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Draw:
    task: str
    index: int


class TaskSampler:
    def __init__(self, weights: dict[str, float], seed: int) -> None:
        self.names = list(weights)
        self.weights = [weights[n] for n in self.names]
        self.seed = seed
        self.cursors = {n: 0 for n in self.names}

    def draw(self, step: int, n: int, round_index: int = 0) -> list[Draw]:
        """Draw ``n`` items for ``step``; extra rounds within a step (dynamic sampling) get their own choices."""
        rng = random.Random(f"{self.seed}-{step}" if round_index == 0 else f"{self.seed}-{step}-{round_index}")
        chosen = rng.choices(self.names, weights=self.weights, k=n)
        out = []
        for name in chosen:
            out.append(Draw(name, self.cursors[name]))
            self.cursors[name] += 1
        return out

    def realised_ratio(self) -> dict[str, float]:
        total = sum(self.cursors.values()) or 1
        return {n: c / total for n, c in self.cursors.items()}

    def state_dict(self) -> dict:
        return {"cursors": dict(self.cursors)}

    def load_state_dict(self, state: dict) -> None:
        self.cursors.update(state["cursors"])
