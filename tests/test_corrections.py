"""Off-policy corrections (polyrl/algorithms/corrections.py) against numbers worked out by hand."""

import math

import pytest
import torch

from polyrl.algorithms.corrections import (
    correct_off_policy,
    importance_weight,
    m2po_mask,
    truncated_importance_weight,
)
from polyrl.algorithms.losses import PolicyLossInputs, ppo_clip_loss


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
    loss, _ = ppo_clip_loss(PolicyLossInputs(logp, old, weighted, kept, agg="token-mean"))
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
    plain, _ = ppo_clip_loss(PolicyLossInputs(logp, prox, adv, mask))
    for mode in ("decoupled", "tis", "m2po"):
        old, a, kept, _ = correct_off_policy(mode, prox, prox, adv, mask)
        loss, _ = ppo_clip_loss(PolicyLossInputs(logp, old, a, kept))
        assert torch.allclose(loss, plain), mode


def test_mismatch_metrics_by_hand():
    from polyrl.algorithms.mismatch import mismatch_metrics, mismatch_sums

    learner = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)], [math.log(0.3), 0.0, 0.0]])
    engine = torch.tensor([[math.log(0.4), math.log(0.9), math.log(0.4)], [math.log(0.3), 0.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the -5 token is masked and must not count
    # ratios 1.25, 1, 0.5, 1: log-ratios log 1.25, 0, log 0.5, 0; beyond the 0.2 band: 1.25 and 0.5
    sums = mismatch_sums(learner, engine, mask, band=0.2)
    m = mismatch_metrics(sums)
    assert math.isclose(m["mismatch/log_ratio"], (math.log(1.25) + math.log(0.5)) / 4, rel_tol=1e-5)
    assert math.isclose(m["mismatch/abs_log_ratio/max"], math.log(2), rel_tol=1e-5)
    assert m["mismatch/beyond_band_frac"] == 0.5
    k3 = (0.25 - math.log(1.25)) + (-0.5 - math.log(0.5))
    assert math.isclose(m["mismatch/kl"], k3 / 4, rel_tol=1e-5)
    assert mismatch_metrics(mismatch_sums(learner, engine, torch.zeros(2, 3), 0.2)) == {}


def test_mis_truncates_or_drops_the_sequence_ratio():
    from polyrl.algorithms.mismatch import mis_weights

    prox = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # sequence log-ratios: 0.5 + 0.5 = 1 (ratio e = 2.72), -0.3 (0.74), and 0.2 + (masked 9.0) = 0.2 (1.22)
    behaviour = torch.tensor([[-0.5, -0.5], [0.3, 0.0], [-0.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    w = mis_weights(prox, behaviour, mask, cap=2.0)
    assert torch.allclose(w.flatten(), torch.tensor([2.0, math.exp(-0.3), math.exp(0.2)]))
    w = mis_weights(prox, behaviour, mask, cap=2.0, drop=True)
    assert torch.allclose(w.flatten(), torch.tensor([0.0, math.exp(-0.3), math.exp(0.2)]))


def test_icepop_keeps_ratios_inside_the_band_and_zeroes_the_rest():
    from polyrl.algorithms.mismatch import icepop_weights

    prox = torch.zeros(1, 4)
    behaviour = torch.log(torch.tensor([[1 / 0.4, 1 / 0.5, 1 / 3.0, 1 / 6.0]]))  # ratios 0.4, 0.5, 3, 6
    w = icepop_weights(prox, behaviour, torch.ones(1, 4), alpha=0.5, beta=5.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 3.0, 0.0]]))


def test_geo_mask_keeps_sequences_whose_mean_log_ratio_is_in_band():
    from polyrl.algorithms.mismatch import geometric_mean_mask

    prox = torch.zeros(3, 2)
    # mean log-ratios: (0.02 - 0.02)/2 = 0 -> kept; (0.03 + 0.01)/2 = 0.02 > log 1.01 -> masked;
    # one counted token of -0.005 (the other masked) -> log 0.99 = -0.01005 <= -0.005 -> kept
    behaviour = torch.tensor([[-0.02, 0.02], [-0.03, -0.01], [0.005, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    keep = geometric_mean_mask(prox, behaviour, mask, low=0.99, high=1.01)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]


def test_prob_mask_flags_big_probability_gaps_not_big_ratios():
    from polyrl.algorithms.mismatch import probability_difference_mask

    # 1e-4 vs 3e-4 (ratio 3, gap 2e-4) stays; 0.9 vs 0.6 (ratio 1.5, gap 0.3) goes; 0.5 vs 0.35 stays
    prox = torch.log(torch.tensor([[1e-4, 0.9, 0.5]]))
    behaviour = torch.log(torch.tensor([[3e-4, 0.6, 0.35]]))
    keep = probability_difference_mask(prox, behaviour, torch.ones(1, 3), eps=0.2)
    assert keep.tolist() == [[1.0, 0.0, 1.0]]


def test_sequence_corrections_through_the_entry_point():
    prox = torch.zeros(2, 2)
    behaviour = torch.tensor([[-0.5, -0.5], [0.0, 0.0]])
    adv, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 2)
    old, a, kept, m = correct_off_policy("mis", prox, behaviour, adv, mask, kwargs={"cap": 2.0, "drop": True})
    assert torch.equal(old, prox)
    assert kept.tolist() == [[0.0, 0.0], [1.0, 1.0]] and a.flatten().tolist() == [0.0, -2.0]
    assert m["off_policy/masked_frac"] == 0.5 and m["off_policy/seq_masked_frac"] == 0.5
    _, a, kept, m = correct_off_policy("geo_mask", prox, behaviour, adv, mask)
    assert kept.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_correction_settings_out_of_range_fail_naming_the_key():
    import pytest

    from polyrl.algorithms.validate import check_algorithm
    from polyrl.config import AlgorithmConfig

    with pytest.raises(ValueError, match=r"algorithm.off_policy.kwargs: .*alpha <= beta"):
        check_algorithm(AlgorithmConfig(off_policy={"correction": "icepop", "kwargs": {"alpha": 3.0, "beta": 2.0}}))
    with pytest.raises(ValueError, match=r"algorithm.off_policy.kwargs: .*eps >= 0"):
        check_algorithm(AlgorithmConfig(off_policy={"correction": "prob_mask", "kwargs": {"eps": -0.1}}))
    with pytest.raises(ValueError, match=r"algorithm.off_policy.kwargs.tau: not a parameter"):
        check_algorithm(AlgorithmConfig(off_policy={"correction": "mis", "kwargs": {"tau": 1.0}}))
    with pytest.raises(ValueError, match=r"algorithm.off_policy.kwargs: off_policy 'tis' takes no kwargs"):
        check_algorithm(AlgorithmConfig(off_policy={"correction": "tis", "kwargs": {"cap": 1.0}}))
    from polyrl.config import ConfigError
    from polyrl.config_check import load_config

    for override, named in (("algorithm.off_policy=icepopp", "algorithm.off_policy"),
                            ("algorithm.off_policy.kwargs={alpha: 3, beta: 2}", "algorithm.off_policy.kwargs")):
        with pytest.raises(ConfigError) as err:
            load_config("configs/quickstart.yaml", ["algorithm.off_policy=icepop", override])
        assert named in str(err.value) and len(str(err.value).strip().splitlines()) == 1, str(err.value)


def _own_logprobs(learner, trajectories):
    """Each trajectory's response log-probs under the learner's current weights, aligned with input_ids."""
    from polyrl.learner.batch import collate
    from polyrl.learner.logprobs import token_logprobs

    batch = collate(trajectories, pad_id=2)
    with torch.no_grad():
        logp, _ = token_logprobs(learner.model, batch, temperature=1.0, bf16=False)
    for i, t in enumerate(trajectories):
        s = t.prompt_len
        t.logprobs = [0.0] * s + logp[i, : len(t.input_ids) - s].tolist()


@pytest.mark.slow
def test_learner_logs_the_mismatch_every_step_and_applies_each_correction():
    from algo_helpers import fake_trajectories, make_learner

    for mode in ("none", "mis", "icepop", "geo_mask", "prob_mask"):
        learner = make_learner(off_policy=mode, regularisers={"track_kl": False})
        ts = fake_trajectories()
        _own_logprobs(learner, ts)
        ts[0].logprobs[3] -= 1.0  # the engine found one token e times less likely than the learner does
        m = learner.update(ts)
        # 12 counted tokens, one log-ratio of +1 (ratio e, beyond the 0.2 band), k3 = e - 2
        assert math.isclose(m["mismatch/log_ratio"], 1 / 12, rel_tol=1e-4), mode
        assert math.isclose(m["mismatch/abs_log_ratio/max"], 1.0, rel_tol=1e-4)
        assert math.isclose(m["mismatch/beyond_band_frac"], 1 / 12, rel_tol=1e-4)
        assert math.isclose(m["mismatch/kl"], (math.e - 2) / 12, rel_tol=1e-3)
        # what each correction leaves out: mis (cap 2) truncates the weight e of sequence 0 and masks nothing;
        # icepop (beta 5) keeps ratio e; geo_mask drops sequence 0 (mean log-ratio 1/3); prob_mask drops the
        # token when its probability moved by more than 0.2
        expected = {"none": None, "mis": 0.0, "icepop": 0.0, "geo_mask": 3 / 12}
        if mode in expected and expected[mode] is not None:
            assert math.isclose(m["off_policy/masked_frac"], expected[mode], abs_tol=1e-6), mode
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
