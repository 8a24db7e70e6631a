"""Entropy held at a target: the entropy bonus's coefficient as a controller of the policy's entropy."""

from __future__ import annotations

import math


def adaptive_entropy_coef(coef: float, entropy: float | None, target: float, step: float, max_coef: float) -> float:
    """Skywork-OR1 (He et al. 2025, "Skywork Open Reasoner 1 Technical Report", arXiv 2505.22312, adaptive
    entropy control): the next step's entropy coefficient from this step's ``coef`` and the policy's measured
    token-mean ``entropy`` (nats per token),

        coef + step   (at most max_coef)   when entropy < target,
        coef - step   (at least 0)         when entropy > target,
        coef                               when they are equal.

    A fixed entropy bonus is either too weak to stop the entropy collapsing as RL sharpens the policy, or
    strong enough to blow it up once the policy stops sharpening; a coefficient that follows the measured
    entropy pushes only as hard as it takes to keep it near the target. ``max_coef`` bounds the push on a
    policy whose entropy will not rise. A step without a measurement (None, NaN or inf: a skipped update)
    leaves the coefficient where it is.
    """
    if entropy is None or not math.isfinite(entropy):
        return coef
    if entropy < target:
        return min(coef + step, max_coef)
    if entropy > target:
        return max(coef - step, 0.0)
    return coef
