"""Staleness: how many policy versions behind the learner the tokens it trains on were sampled, and the bound
``runtime.eta`` on it."""

from __future__ import annotations

from polyrl.types import Trajectory


def staleness_metrics(trajectories: list[Trajectory], learner_version: int) -> dict[str, float]:
    """Version lag of the trained tokens (learner version minus the version that sampled each model token),
    and the share of trajectories whose tokens span several versions (partial rollouts)."""
    lags: list[int] = []
    mixed = 0
    for t in trajectories:
        versions = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        lags += [learner_version - v for v in versions]
        mixed += len(set(versions)) > 1
    return {
        "staleness/mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness/max": float(max(lags, default=0)),
        "staleness/mixed_version_frac": mixed / len(trajectories) if trajectories else 0.0,
    }


def check_staleness(trajectories: list[Trajectory], learner_version: int, eta: int, where: str) -> None:
    """Raise if any trained token was sampled by a policy older than ``learner_version - eta``."""
    oldest = min((v for t in trajectories for v, m in zip(t.versions, t.loss_mask, strict=True) if m), default=None)
    if oldest is not None and oldest < learner_version - eta:
        raise RuntimeError(
            f"{where}: a token of policy version {oldest} reached learner version {learner_version}, "
            f"beyond runtime.eta={eta}"
        )
