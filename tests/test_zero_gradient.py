"""Learner: a batch whose loss has no gradient (every advantage 0, no other loss term) skips the forward and
backward passes and leaves the weights and optimizer exactly where the full update would."""

import pytest
import torch

from polyrl.config import AlgorithmConfig, OptimConfig
from polyrl.learner.learner import Learner
from polyrl.models.loading import tiny_random_model
from polyrl.types import Trajectory


def _trajs(advantages):
    out = []
    for i, a in enumerate(advantages):
        prompt, response = [5, 6, 7, 8], [20 + i, 21, 22 + i][: 1 + i % 3]
        ids = prompt + response
        out.append(Trajectory(task="t", item_id=i // 2, group_id=i // 2, input_ids=ids,
                              loss_mask=[0] * len(prompt) + [1] * len(response), logprobs=[0.0] * len(ids),
                              versions=[0] * len(ids), advantage=a))
    return out


def _learner(seed=0, **algo):
    model = tiny_random_model(seed=seed, vocab_size=64)
    algo = AlgorithmConfig(**{"regularisers": {"track_kl": False}, **algo})
    return Learner(model, algo, OptimConfig(lr=1e-2, weight_decay=0.1), 1.0, False, pad_id=2, total_steps=10)


@pytest.mark.parametrize("epochs", [1, 2])
def test_zero_advantage_update_equals_the_full_one(monkeypatch, epochs):
    full, short = _learner(loss={"epochs": epochs}), _learner(loss={"epochs": epochs})
    signal, silent = _trajs([1.0, -1.0, 0.5, -0.5]), _trajs([0.0] * 4)
    for learner in (full, short):
        learner.update(signal)  # AdamW moments from a real gradient, so a zero-gradient step still moves
    monkeypatch.setattr(full, "_gradient_is_zero", lambda batch: False)  # the full passes, for reference
    before = [p.detach().clone() for p in full.params]
    full_metrics = full.update(silent)

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward pass ran")

    monkeypatch.setattr(short, "_forward", no_forward)
    metrics = short.update(silent)
    assert metrics["zero_gradient"] == 1.0 and full_metrics["zero_gradient"] == 0.0
    assert metrics["grad_norm"] == full_metrics["grad_norm"] == 0.0
    assert metrics["entropy"] is None and metrics["lr"] == full_metrics["lr"]
    assert any(not torch.equal(a, p) for a, p in zip(before, full.params, strict=True))  # momentum moved it
    for a, b in zip(full.params, short.params, strict=True):
        assert torch.equal(a, b)
    state_a, state_b = full.optimizer.state_dict()["state"], short.optimizer.state_dict()["state"]
    for k in state_a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state_a[k][name], state_b[k][name])


@pytest.mark.parametrize(
    "algo, advantages",
    [
        ({}, [0.0, 0.0, 0.5, 0.0]),  # one row carries signal
        ({"regularisers": {"entropy_coef": 0.01, "track_kl": False}}, [0.0] * 4),  # the entropy bonus has a gradient
        ({"regularisers": {"track_kl": True}}, [0.0] * 4),  # the KL is measured from a forward pass
        ({"regularisers": {"kl_coef": 0.1, "track_kl": False}}, [0.0] * 4),
    ],
)
def test_other_terms_keep_the_passes(algo, advantages):
    learner = _learner(**algo)
    metrics = learner.update(_trajs(advantages))
    assert metrics["zero_gradient"] == 0.0 and metrics["entropy"] is not None


def test_only_losses_linear_in_the_advantage_skip(monkeypatch):
    from polyrl.algorithms import LOSSES

    def shifted(x, **kwargs):  # a loss with a term that ignores the advantage
        return -(x.logp * x.mask).sum() / x.mask.sum(), {"clip_frac": 0.0}

    monkeypatch.setitem(LOSSES._items, "shifted_test_loss", shifted)
    learner = _learner()
    learner.algo.loss = "shifted_test_loss"
    metrics = learner.update(_trajs([0.0] * 4))
    assert metrics["zero_gradient"] == 0.0 and metrics["grad_norm"] > 0


def test_sft_on_successes_trains_groups_that_all_succeeded():
    # every sample of both groups succeeded: zero advantages, yet SFT on successes has a gradient
    learner = _learner(regularisers={"track_kl": False, "sft_coef": 1.0})
    passed = _trajs([0.0] * 4)
    for t in passed:
        t.reward = 1.0
    metrics = learner.update(passed)
    assert metrics["zero_gradient"] == 0.0 and metrics["grad_norm"] > 0 and metrics["loss/sft"] > 0
    # below the bar nothing is a success: the passes run (the term is on) and the gradient is exactly 0
    failed = _learner(regularisers={"track_kl": False, "sft_coef": 1.0}).update(_trajs([0.0] * 4))
    assert failed["zero_gradient"] == 0.0 and failed["grad_norm"] == 0.0 and failed["loss/sft"] == 0.0
