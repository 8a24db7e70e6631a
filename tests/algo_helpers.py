"""Shared helpers for the algorithm tests: hand-made trajectories and a learner on a tiny random model."""

from polyrl.config import AlgorithmConfig, OptimConfig
from polyrl.learner.learner import Learner
from polyrl.models.loading import tiny_random_model
from polyrl.types import Trajectory


def fake_trajectories(n: int = 4) -> list[Trajectory]:
    """One group of ``n`` samples: a 3-token prompt and a 3-token response; odd samples have reward 1."""
    out = []
    for i in range(n):
        prompt, resp = [5, 6, 7], [10 + i, 11 + i, 2]
        out.append(Trajectory(
            task="t", item_id=0, group_id=0, input_ids=prompt + resp, loss_mask=[0, 0, 0, 1, 1, 1],
            logprobs=[0.0] * 6, versions=[-1] * 6, reward=float(i % 2), advantage=1.0 if i % 2 else -1.0,
        ))
    return out


def make_learner(lr: float = 1e-3, **algo) -> Learner:
    model = tiny_random_model(seed=0, vocab_size=64)
    return Learner(model, AlgorithmConfig(**algo), OptimConfig(lr=lr), 1.0, False, pad_id=2)
