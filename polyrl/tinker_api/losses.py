"""Tinker's built-in losses, per datum and per token, summed (never averaged) as Tinker defines them.

Every tensor is a datum's ``(N,)`` vector aligned with its input tokens: ``target_logprobs`` are the learner's
log-probs of ``target_tokens`` (temperature 1), ``logprobs`` the sampler's, ``advantages`` and ``weights`` the
caller's. Each function returns the per-token loss; a datum's loss is its sum and the batch's loss the sum over
datums. Clipping thresholds are ratios (``loss_fn_config``: ``clip_low_threshold`` 0.8 and
``clip_high_threshold`` 1.2 unless given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.tinker_api.wire import WireError

Config = dict[str, float | str]


@dataclass(frozen=True)
class TinkerLoss:
    inputs: tuple[str, ...]
    """The ``loss_fn_inputs`` each datum must carry besides ``target_tokens``."""
    config: tuple[str, ...]
    """The ``loss_fn_config`` keys it reads."""
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], Config], torch.Tensor]
    gradient_weight: str | None
    """The input that is zero wherever the loss has no gradient (None: any position may have one); the learner
    computes the positions before its first nonzero value without gradients."""


def _ratio(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(target_logprobs - inputs["logprobs"])


def _clip(config: Config) -> tuple[float, float]:
    return float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))


def cross_entropy(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    return -target_logprobs * inputs["weights"]


def importance_sampling(
    target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config
) -> torch.Tensor:
    return -_ratio(target_logprobs, inputs) * inputs["advantages"]


def ppo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    ratio, advantages = _ratio(target_logprobs, inputs), inputs["advantages"]
    low, high = _clip(config)
    return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)


def cispo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    low, high = _clip(config)
    weight = _ratio(target_logprobs, inputs).clamp(low, high).detach()
    return -weight * target_logprobs * inputs["advantages"]


def dro(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    beta = float(config["beta"])
    penalty = (target_logprobs - inputs["logprobs"]) ** 2
    return -(target_logprobs * inputs["advantages"] - 0.5 * beta * penalty)


LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss(("weights",), (), cross_entropy, "weights"),
    "importance_sampling": TinkerLoss(("logprobs", "advantages"), (), importance_sampling, "advantages"),
    "ppo": TinkerLoss(("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold"), ppo, "advantages"),
    "cispo": TinkerLoss(("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold"), cispo,
                        "advantages"),
    "dro": TinkerLoss(("logprobs", "advantages"), ("beta",), dro, None),  # its penalty reads every position
}

REFUSED = {
    "gspo": "it needs the sequence-level ratio mask the server does not implement",
    # Tinker documents neither its objective nor what the sampler records for it, so it is not reproduced.
    "stable_reinforce": "its objective and the stability information its sampler records are server-side in "
                        "Tinker and undocumented; pass loss_fn='importance_sampling' instead (in a cookbook "
                        "recipe's config: loss_fn=importance_sampling)",
    "custom": "server-side custom losses are not implemented; forward_backward_custom runs them on the client",
}


def check_loss(name: str, config: Config) -> TinkerLoss:
    """The loss ``name``, with its config checked; a WireError naming what is unsupported otherwise."""
    if name in REFUSED:
        raise WireError(f"loss_fn '{name}' is not supported: {REFUSED[name]} (supported: {', '.join(LOSSES)})")
    if name not in LOSSES:
        raise WireError(f"unknown loss_fn '{name}' (supported: {', '.join(LOSSES)})")
    loss = LOSSES[name]
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        raise WireError(f"loss_fn '{name}': unknown loss_fn_config keys {unknown} (it reads: "
                        f"{', '.join(loss.config) or 'none'})")
    if name == "dro" and "beta" not in config:
        raise WireError("loss_fn 'dro' needs loss_fn_config['beta']")
    for key, value in config.items():
        if isinstance(value, str):
            raise WireError(f"loss_fn '{name}': loss_fn_config['{key}'] must be a number, not '{value}'")
    return loss


def check_inputs(loss_name: str, loss: TinkerLoss, row: int, length: int, inputs: dict[str, torch.Tensor]) -> None:
    """Each datum carries ``target_tokens`` and the loss's inputs, one value per input token, and nothing else
    (a key the loss would not read is more likely a mistake than a wish)."""
    extra = sorted(set(inputs) - {"target_tokens", *loss.inputs})
    if extra:
        raise WireError(f"data[{row}]: loss_fn '{loss_name}' does not read loss_fn_inputs {extra} (it reads "
                        f"target_tokens, {', '.join(loss.inputs)})")
    for key in ("target_tokens", *loss.inputs):
        if key not in inputs:
            raise WireError(f"data[{row}]: loss_fn '{loss_name}' needs loss_fn_inputs['{key}']")
        tensor = inputs[key]
        if tensor.dim() != 1:
            raise WireError(f"data[{row}].loss_fn_inputs['{key}']: expected shape ({length},), got "
                            f"{tuple(tensor.shape)} (per-position distributions are not supported)")
        if tensor.shape[0] != length:
            raise WireError(f"data[{row}].loss_fn_inputs['{key}']: {tensor.shape[0]} values for {length} "
                            "input tokens")
