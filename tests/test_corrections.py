"""Off-policy corrections (polyrl/algorithms/corrections.py) against numbers worked out by hand."""

import math

import torch

from polyrl.algorithms.corrections import (
    correct_off_policy,
    importance_weight,
    m2po_mask,
    truncated_importance_weight,
)
from polyrl.algorithms.losses import ppo_clip_loss


def test_importance_weight_and_its_truncation():
    prox = torch.tensor([[-0.5, -1.0, -3.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -0.5]])
    w = importance_weight(prox, behaviour)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), 1.0, math.exp(-2.5)]]))
    big = torch.tensor([[0.0, math.log(3.0)]])
    assert torch.allclose(truncated_importance_weight(big, torch.zeros(1, 2), cap=2.0), torch.tensor([[1.0, 2.0]]))


def test_m2po_drops_the_largest_squared_log_ratios_until_the_mean_is_under_tau():
    # squares 0.01, 0.25, 0.0025, 0: prefix means of the sorted squares are 0, 0.00125, 0.00417, 0.0656,
    # so with tau 0.04 three tokens stay and the 0.5 log-ratio token goes.
    log_ratio = torch.tensor([[0.1, 0.5, -0.05, 0.0]])
    mask = torch.ones(1, 4)
    assert m2po_mask(log_ratio, mask, 0.04).tolist() == [[1.0, 0.0, 1.0, 1.0]]
    # tau 0.003 keeps only the two smallest (prefix means 0, 0.00125; the third is 0.00417)
    assert m2po_mask(log_ratio, mask, 0.003).tolist() == [[0.0, 0.0, 1.0, 1.0]]
    # masked-out positions never come back, however small their ratio
    assert m2po_mask(log_ratio, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 1.0).tolist() == [[1.0, 1.0, 1.0, 0.0]]
    # ties at the threshold keep exactly as many tokens as the bound allows
    ties = m2po_mask(torch.tensor([[0.3, 0.3, 0.3]]), torch.ones(1, 3), 0.09)
    assert ties.sum() == 3
    assert m2po_mask(torch.tensor([[0.3, 0.3, 0.0]]), torch.ones(1, 3), 0.05).tolist() == [[1.0, 0.0, 1.0]]


def test_decoupled_ppo_is_the_weighted_ppo_objective_per_token():
    logp = torch.tensor([[-0.9, -2.0, -0.2]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.8, -0.3]])
    behaviour = torch.tensor([[-1.2, -1.0, -0.3]])
    adv, mask = torch.tensor([1.5]), torch.ones(1, 3)
    old, weighted, kept, metrics = correct_off_policy("decoupled", prox, behaviour, adv, mask)
    loss, _ = ppo_clip_loss(logp, old, weighted, kept, agg="token-mean")
    # by hand: r = exp(logp - prox) = [1.105, 0.819, 1.105]; clip at 1.2/0.8 leaves them; w = exp(prox - mu)
    r = torch.exp(logp.detach() - prox)
    w = torch.exp(prox - behaviour)
    expected = -(torch.minimum(r * 1.5, r.clamp(0.8, 1.2) * 1.5) * w).mean()
    assert torch.allclose(loss.detach(), expected)
    assert math.isclose(metrics["off_policy/is_weight/max"], math.exp(0.2), rel_tol=1e-5)
    assert metrics["off_policy/masked_frac"] == 0.0


def test_tis_caps_and_m2po_masks_through_the_same_entry_point():
    prox = torch.tensor([[0.0, 0.0]])
    behaviour = torch.tensor([[-2.0, 0.0]])  # weights e^2 = 7.39 and 1
    _, adv, _, m = correct_off_policy("tis", prox, behaviour, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0)
    assert adv.tolist() == [[2.0, 1.0]]
    assert m["off_policy/truncated_frac"] == 0.5
    old, adv, kept, m = correct_off_policy("m2po", prox, behaviour, torch.tensor([1.0]), torch.ones(1, 2))
    assert torch.equal(old, behaviour)  # M2PO's ratio is to the behaviour policy
    assert kept.tolist() == [[0.0, 1.0]] and m["off_policy/masked_frac"] == 0.5


def test_on_fresh_samples_every_correction_leaves_ppo_unchanged():
    # Behaviour == proximal (a synchronous step): weights are 1 and nothing is masked.
    logp = torch.tensor([[-0.7, -1.1, -0.4, -2.0]], requires_grad=True)
    prox = logp.detach() + 0.0
    adv, mask = torch.tensor([-0.8]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    plain, _ = ppo_clip_loss(logp, prox, adv, mask)
    for mode in ("decoupled", "tis", "m2po"):
        old, a, kept, _ = correct_off_policy(mode, prox, prox, adv, mask)
        loss, _ = ppo_clip_loss(logp, old, a, kept)
        assert torch.allclose(loss, plain), mode
