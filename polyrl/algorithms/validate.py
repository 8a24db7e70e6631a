"""Up-front checks of ``algorithm.*``: names exist in the registries and their keyword arguments fit.

A wrong keyword or value fails at config load with one line naming the key, not at step 1 of a long run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from polyrl.algorithms.advantages import ADVANTAGES
from polyrl.algorithms.losses import LOSSES, PolicyLossInputs
from polyrl.algorithms.mismatch import CORRECTIONS

# Arguments the framework passes itself; a kwargs entry may not override them.
LOSS_ARGS = ("x", *PolicyLossInputs.__dataclass_fields__)
ADVANTAGE_ARGS = ("rewards", "group_ids")
CORRECTION_ARGS = ("proximal_logp", "behaviour_logp", "mask")


def check_kwargs(
    fn: Callable, kwargs: dict[str, Any], reserved: tuple[str, ...], key: str, what: str
) -> None:
    """Every entry of ``kwargs`` must be a keyword parameter of ``fn`` that the framework does not set."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    own = [n for n, p in params.items() if n not in reserved and p.kind is not inspect.Parameter.VAR_KEYWORD]
    for name in kwargs:
        if name in reserved:
            raise ValueError(f"{key}.{name}: set by the framework, not by {key}")
        if name not in own and not takes_any:
            valid = ", ".join(own) or "none"
            raise ValueError(f"{key}.{name}: not a parameter of {what}; its parameters: {valid}")


def check_loss_signature(loss_fn: Callable, what: str) -> None:
    """A policy loss takes one ``PolicyLossInputs`` and its own keywords; a loss written for separate tensors
    (``logp, old_logp, advantages, mask, ...``) is refused with how to write it."""
    required = [n for n, p in inspect.signature(loss_fn).parameters.items()
                if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(required) != 1:
        shown = ", ".join(required[:4]) + (", ..." if len(required) > 4 else "")
        raise ValueError(f"algorithm.loss: {what} takes ({shown}); a policy loss takes one PolicyLossInputs and "
                         "its own keywords: def loss(x: PolicyLossInputs, **kwargs) (docs/algorithms.md)")


def anchor_topk_size(loss_fn: Callable, loss_kwargs: dict[str, Any]) -> int:
    """K when the learner hands this loss the policy's logits and the top-K tokens of the policy at the
    update's start (a ``topk`` parameter in its signature and ``algorithm.loss.kwargs.topk`` > 0), else 0."""
    if "topk" not in inspect.signature(loss_fn).parameters:
        return 0
    k = loss_kwargs.get("topk", 0)
    if not isinstance(k, int) or isinstance(k, bool):
        raise ValueError(f"algorithm.loss.kwargs.topk: a whole number of tokens, got {k!r}")
    return k


def _probe(
    fn: Callable, args: tuple, common: dict[str, Any], kwargs: dict[str, Any], key: str, what: str
) -> None:
    """Call the function once on a tiny example so a bad value (e.g. dual_clip c <= 1) fails now."""
    try:
        fn(*args, **common, **kwargs)
    except Exception as exc:  # any failure here is a config problem, reported on one line
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{key}: {what} rejected {kwargs}: {detail}") from None


def check_algorithm(algo: Any, group_size: int | None = None) -> None:
    """Validate an ``AlgorithmConfig`` (for groups of ``group_size`` samples, when known); raise ValueError with
    a one-line message naming the key."""
    adv, loss = algo.advantage, algo.loss
    ADVANTAGES.check(adv.estimator, key="algorithm.advantage")
    check_pass_at_k(adv.estimator, adv.kwargs, group_size)
    LOSSES.check(loss.name, key="algorithm.loss")
    adv_fn, loss_fn = ADVANTAGES[adv.estimator], LOSSES[loss.name]
    adv_what, loss_what = f"advantage estimator '{adv.estimator}'", f"policy loss '{loss.name}'"
    check_kwargs(adv_fn, adv.kwargs, ADVANTAGE_ARGS, "algorithm.advantage.kwargs", adv_what)
    check_loss_signature(loss_fn, loss_what)
    check_kwargs(loss_fn, loss.kwargs, LOSS_ARGS, "algorithm.loss.kwargs", loss_what)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    _probe(adv_fn, (rewards, groups), {}, adv.kwargs, "algorithm.advantage.kwargs", adv_what)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    topk = anchor_topk_size(loss_fn, loss.kwargs) > 0  # then a 3-token vocabulary, the anchor's top 1
    inputs = PolicyLossInputs(
        logp, logp - 0.1, torch.tensor([1.0, -1.0]), torch.ones(2, 2), loss.clip_low, loss.clip_high,
        loss.agg, 4.0, behaviour_logp=logp - 0.2,
        logits=torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(2, 2, 3) if topk else None,
        anchor_topk=(torch.zeros(2, 2, 1, dtype=torch.long), torch.full((2, 2, 1), math.log(0.4))) if topk else None,
    )
    _probe(loss_fn, (inputs,), {}, loss.kwargs, "algorithm.loss.kwargs", loss_what)
    check_correction(algo)


def check_pass_at_k(estimator: str, kwargs: dict[str, Any], group_size: int | None) -> None:
    """pass_at_k's ``k`` is a whole number from 1 to the group size: a group of n samples has no k-subsets for
    k > n, so pass@k above n is not estimated from it (``advantages.pass_at_k_advantages``)."""
    if estimator != "pass_at_k":
        return
    k = kwargs.get("k")
    top = f"rollout.group_size ({group_size})" if group_size is not None else "the group size"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (group_size is not None and k > group_size):
        raise ValueError(f"algorithm.advantage.kwargs.k: pass_at_k needs a whole number 1 <= k <= {top}, "
                         f"got {k!r}")


def check_correction(algo: Any) -> None:
    """``algorithm.off_policy.kwargs`` fit the correction named by ``algorithm.off_policy.correction``."""
    key, off = "algorithm.off_policy.kwargs", algo.off_policy
    if off.correction not in CORRECTIONS:
        if off.kwargs:
            raise ValueError(f"{key}: off_policy '{off.correction}' takes no kwargs (its settings are "
                             f"algorithm.off_policy.tis_cap / algorithm.off_policy.m2po_tau)")
        return
    fn, what = CORRECTIONS[off.correction], f"off-policy correction '{off.correction}'"
    check_kwargs(fn, off.kwargs, CORRECTION_ARGS, key, what)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    _probe(fn, (logp, logp - 0.1, torch.ones(2, 2)), {}, off.kwargs, key, what)
