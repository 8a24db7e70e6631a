"""Policy losses against hand-worked numbers, and a user-registered loss used from config."""

import math

import pytest
import torch
from algo_helpers import fake_trajectories, make_learner
from conftest import SMOKE

from polyrl.algorithms import LOSSES, aggregate
from polyrl.algorithms.losses import PolicyLossInputs, ppo_clip_loss
from polyrl.config import ConfigError
from polyrl.config_check import load_config
from polyrl.learner.advantage_stage import token_advantages
from polyrl.learner.batch import collate

LOG15 = math.log(1.5)
BUILT_IN = ["ppo_clip", "dual_clip", "gspo", "cispo", "dppo", "sapo"]


def one_token(ratio: float, adv: float):
    """A batch of one sequence with one token whose importance ratio is ``ratio``; logp is a leaf."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-math.log(ratio)]])
    return logp, old, torch.tensor([adv]), torch.ones(1, 1)


def test_aggregation_modes():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per_token, mask, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)


def test_ppo_clip_clips_the_good_side_and_keeps_the_bad_side():
    # ratio 1.5, A = +1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped, no gradient
    logp, old, adv, mask = one_token(1.5, 1.0)
    loss, m = ppo_clip_loss(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"] == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, not clipped, d loss / d logp = -A * ratio = 1.5
    logp, old, adv, mask = one_token(1.5, -1.0)
    loss, m = ppo_clip_loss(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))
    assert loss.item() == pytest.approx(1.5) and m["clip_frac"] == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(1.5)


def test_clip_higher_is_asymmetric():
    # ratio 1.25, A = +1: clip_high 0.28 leaves it alone (loss -1.25), clip_high 0.2 clips it (-1.2)
    logp, old, adv, mask = one_token(1.25, 1.0)
    assert ppo_clip_loss(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.28))[0].item() == pytest.approx(-1.25)
    assert ppo_clip_loss(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))[0].item() == pytest.approx(-1.2)


def test_dual_clip_bounds_negative_advantage_losses():
    dual = LOSSES["dual_clip"]
    # ratio 5, A = -1, c = 3: PPO objective min(-5, -1.2) = -5; floor c*A = -3 -> objective -3, loss 3,
    # and no gradient
    logp, old, adv, mask = one_token(5.0, -1.0)
    loss, m = dual(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2), c=3.0)
    assert loss.item() == pytest.approx(3.0) and m["dual_clip_frac"] == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    plain_ppo = ppo_clip_loss(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))[0].item()
    assert plain_ppo == pytest.approx(5.0)
    # ratio 2, A = -1: objective -2 is above the floor -3 -> loss 2, gradient as in PPO (-A * ratio = 2)
    logp, old, adv, mask = one_token(2.0, -1.0)
    loss, m = dual(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2), c=3.0)
    assert loss.item() == pytest.approx(2.0) and m["dual_clip_frac"] == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0)
    # positive advantages are untouched: ratio 5, A = +1 -> PPO's -1.2
    logp, old, adv, mask = one_token(5.0, 1.0)
    assert dual(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2), c=3.0)[0].item() == pytest.approx(-1.2)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    gspo = LOSSES["gspo"]
    # logp - old = [log 2, 0, (pad: log 100)] -> s = exp(log 2 / 2) = sqrt(2); A = 1
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-math.log(2.0), 0.0, -math.log(100.0)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0])
    loss, m = gspo(PolicyLossInputs(logp, old, adv, mask, 0.5, 0.5, agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(-math.sqrt(2))  # inside [0.5, 1.5]: unclipped
    assert m["ratio/mean"] == pytest.approx(math.sqrt(2)) and m["ratio/max"] == pytest.approx(math.sqrt(2))
    loss.backward()
    # d(-s A)/d logp_t = -s / |y| on each valid token, 0 on the pad
    assert logp.grad[0].tolist() == pytest.approx([-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0])
    # the same number from the sequence-level formula directly
    seq = torch.tensor([[0.0, 0.0]], requires_grad=True)
    (-torch.exp((seq - old[:, :2]).mean())).backward()
    assert logp.grad[0, :2].tolist() == pytest.approx(seq.grad[0].tolist())
    # with the paper-sized range it clips: s = 1.414 > 1 + 4e-4 -> objective (1 + 4e-4) * A, no gradient
    logp.grad = None
    loss, m = gspo(PolicyLossInputs(logp, old, adv, mask, 3e-4, 4e-4, agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(-(1 + 4e-4)) and m["clip_frac"] == 1.0


def test_cispo_keeps_a_clipped_weight_as_gradient():
    cispo = LOSSES["cispo"]
    # ratio 1.5, A = +1, clip_high 0.2: weight sg(1.2); value -1.2, d loss / d logp = -1.2 (PPO: 0)
    logp, old, adv, mask = one_token(1.5, 1.0)
    loss, m = cispo(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"] == 1.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.2)
    # ratio 0.9 inside the range, A = -2: weight 0.9; value 1.8, gradient 1.8
    logp, old, adv, mask = one_token(0.9, -2.0)
    loss, m = cispo(PolicyLossInputs(logp, old, adv, mask, 0.2, 0.2))
    assert loss.item() == pytest.approx(1.8) and m["clip_frac"] == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(1.8)


def test_every_loss_reports_ratio_metrics_and_takes_per_token_advantages():
    # ratios 1.5 and 0.5 on the valid tokens (the pad's ratio 9 must not show up)
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[-LOG15, -math.log(9.0)], [-math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for name in BUILT_IN:
        for adv in (torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 0.0], [-1.0, 0.0]])):
            loss, m = LOSSES[name](PolicyLossInputs(logp, old, adv, mask, clip_low=0.2, clip_high=0.2))
            assert torch.isfinite(loss), name
            for key in ("clip_frac", "ratio/mean", "ratio/min", "ratio/max"):
                assert key in m, (name, key)
            if name != "gspo":  # gspo's ratio is per sequence; one valid token each gives the same numbers
                assert (m["ratio/min"], m["ratio/max"]) == pytest.approx((0.5, 1.5)), name
            assert m["ratio/max"] == pytest.approx(1.5), name


def test_sapo_gates_the_ratio_softly():
    # ratio 1.5, A = +1, tau 1: sigmoid(0.5) = 0.622459, objective 4 * 0.622459 = 2.489836; its slope in logp
    # is 4 * sigmoid * (1 - sigmoid) * ratio = 4 * 0.622459 * 0.377541 * 1.5 = 1.410024 (PPO's would be 0)
    logp, old, adv, mask = one_token(1.5, 1.0)
    loss, m = LOSSES["sapo"](PolicyLossInputs(logp, old, adv, mask), tau_pos=1.0, tau_neg=1.05)
    loss.backward()
    assert loss.item() == pytest.approx(-2.489836, abs=1e-5)
    assert logp.grad.item() == pytest.approx(-1.410024, abs=1e-5)
    assert m["sapo/gate_weight"] == pytest.approx(4 * 0.622459 * 0.377541, abs=1e-5) and m["clip_frac"] == 0.0
    # ratio 1, A = -1, tau_neg 1.05: objective -2 / 1.05, slope exactly the policy gradient's, -1
    logp, old, adv, mask = one_token(1.0, -1.0)
    loss, _ = LOSSES["sapo"](PolicyLossInputs(logp, old, adv, mask), tau_pos=1.0, tau_neg=1.05)
    loss.backward()
    assert loss.item() == pytest.approx(2 / 1.05) and logp.grad.item() == pytest.approx(1.0)
    # far from 1 the gate closes: ratio 4, tau 1: weight 4 * sigmoid(3) * (1 - sigmoid(3)) = 0.1807
    logp, old, adv, mask = one_token(4.0, 1.0)
    _, m = LOSSES["sapo"](PolicyLossInputs(logp, old, adv, mask))
    assert m["sapo/gate_weight"] == pytest.approx(0.180707, abs=1e-5) and m["clip_frac"] == 1.0


def test_dppo_masks_only_updates_that_leave_the_divergence_region():
    from polyrl.algorithms.trust_losses import binary_divergence

    def case(p, q, adv, divergence="tv"):
        """Current probability p, behaviour (anchor) probability q; old_logp = log q, so ratio p / q."""
        logp = torch.tensor([[math.log(p)]], requires_grad=True)
        anchor = torch.tensor([[math.log(q)]])
        inputs = PolicyLossInputs(logp, anchor, torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.2, behaviour_logp=anchor)
        loss, m = LOSSES["dppo"](inputs, divergence=divergence)
        loss.backward()
        return loss.item(), logp.grad.item(), m

    # A > 0 pushing a likely token 0.6 -> 0.9: TV 0.3 > 0.2, masked (no loss, no gradient)
    assert case(0.9, 0.6, 1.0)[:2] == (0.0, 0.0)
    # a rare token 1e-4 -> 3e-4 has ratio 3 (PPO would clip it) but TV 2e-4: it trains, loss -3, slope -3
    loss, grad, m = case(3e-4, 1e-4, 1.0)
    assert (loss, grad) == (pytest.approx(-3.0), pytest.approx(-3.0)) and m["clip_frac"] == 0.0
    # A < 0 pushing 0.9 -> 0.6 further down: masked; A < 0 on a token that went up (0.6 -> 0.9) trains
    assert case(0.6, 0.9, -1.0)[:2] == (0.0, 0.0)
    assert case(0.9, 0.6, -1.0)[:2] == (pytest.approx(1.5), pytest.approx(1.5))
    # binary KL(q || p) for q = 0.6, p = 0.9: 0.6 log(0.6 / 0.9) + 0.4 log(0.4 / 0.1) = 0.311239 > 0.2: masked
    kl = binary_divergence(torch.tensor(math.log(0.9)), torch.tensor(math.log(0.6)), "kl")
    assert kl.item() == pytest.approx(0.311239, abs=1e-5)
    assert case(0.9, 0.6, 1.0, "kl")[:2] == (0.0, 0.0)
    # q = 0.6, p = 0.7: KL = 0.6 log(6/7) + 0.4 log(4/3) = 0.022583 < 0.2: trains
    assert case(0.7, 0.6, 1.0, "kl")[0] == pytest.approx(-0.7 / 0.6)


def test_dppo_topk_divergence_by_hand():
    from polyrl.algorithms.trust_losses import topk_divergence

    # pi = [0.5, 0.3, 0.1, 0.1]; the anchor's top 2 are tokens 0 and 1 at 0.4 each (0.2 for the rest)
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.1, 0.1]]]))
    ids, logq = torch.tensor([[[0, 1]]]), torch.log(torch.tensor([[[0.4, 0.4]]]))
    # TV = 1/2 (0.1 + 0.1 + |0.2 - 0.2|) = 0.1; KL = 0.4 log(0.4/0.5) + 0.4 log(0.4/0.3) + 0.2 log(1) = 0.025815
    assert topk_divergence(logits, ids, logq, "tv").item() == pytest.approx(0.1, abs=1e-6)
    assert topk_divergence(logits, ids, logq, "kl").item() == pytest.approx(0.025815, abs=1e-6)


@pytest.mark.slow
def test_dppo_topk_in_the_learner_anchors_on_the_policy_at_the_update_start():
    ts = fake_trajectories()
    # one epoch: the anchor is the pass itself, so every token is inside the region
    m = make_learner(loss={"name": "dppo", "kwargs": {"anchor": "old", "topk": 4}},
                     regularisers={"track_kl": False}).update(ts)
    assert m["dppo/divergence"] == 0.0 and m["clip_frac"] == 0.0
    # two epochs: the second measures against the first pass's top-k. With K = the whole vocabulary (64) the
    # top-k TV is the full TV, never below the binary TV of the sampled token (the same first step in both).
    binary = make_learner(lr=5e-2, loss={"name": "dppo", "kwargs": {"anchor": "old"}, "epochs": 2},
                          regularisers={"track_kl": False}).update(ts)
    full = make_learner(lr=5e-2, loss={"name": "dppo", "kwargs": {"anchor": "old", "topk": 64}, "epochs": 2},
                        regularisers={"track_kl": False}).update(ts)
    assert full["dppo/divergence"] > binary["dppo/divergence"] > 0.0


def test_dppo_topk_config_errors_name_the_key():
    from polyrl.algorithms.validate import check_algorithm
    from polyrl.config import AlgorithmConfig

    for kwargs, words in (({"topk": 4}, "needs anchor: old"), ({"anchor": "old", "topk": -1}, "must be >= 0"),
                          ({"anchor": "old", "topk": "x"}, "a whole number")):
        with pytest.raises(ValueError, match="algorithm.loss.kwargs") as err:
            check_algorithm(AlgorithmConfig(loss={"name": "dppo", "kwargs": kwargs}))
        assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_dppo_in_the_learner_takes_the_behaviour_log_probs():
    ts = fake_trajectories()  # behaviour log-probs 0 (probability 1): every token moved down by > 0.2 TV
    m = make_learner(loss="dppo", regularisers={"track_kl": False}).update(ts)
    # the two A > 0 samples push their tokens back up, toward the engine's: inside the region; the A < 0
    # samples would push them further down: masked. So half the tokens are out of the region.
    assert m["clip_frac"] == pytest.approx(0.5) and m["dppo/divergence"] > 0.2


# A user's own loss: registered with the decorator, chosen by name in the config, with its own keyword.
@LOSSES.register("test_scaled_ppo")
def scaled_ppo(x: PolicyLossInputs, scale=1.0):
    loss, m = ppo_clip_loss(x)
    return scale * loss, {**m, "test/scale": scale}


@LOSSES.register("test_old_signature")
def old_signature(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, agg="token-mean", num_tokens=None):
    raise AssertionError("never called: refused when the config loads")


@pytest.mark.slow
def test_a_user_registered_loss_is_usable_from_config():
    cfg = load_config(SMOKE, ["algorithm.loss=test_scaled_ppo", "algorithm.loss.kwargs={scale: 2.0}"])
    assert cfg.algorithm.loss.name == "test_scaled_ppo" and cfg.algorithm.loss.kwargs == {"scale": 2.0}
    with pytest.raises(ConfigError, match=r"algorithm.loss.kwargs.scal: not a parameter of policy loss"):
        load_config(SMOKE, ["algorithm.loss=test_scaled_ppo", "algorithm.loss.kwargs={scal: 2.0}"])
    with pytest.raises(ConfigError, match=r"algorithm.loss: policy loss 'test_old_signature' takes \(logp, old_logp, "
                                          r"advantages, mask\); a policy loss takes one PolicyLossInputs"):
        load_config(SMOKE, ["algorithm.loss=test_old_signature"])
    scaled = make_learner(loss={"name": "test_scaled_ppo", "kwargs": {"scale": 2.0}}, regularisers={"track_kl": False})
    plain = make_learner(regularisers={"track_kl": False})
    m_scaled, m_plain = scaled.update(fake_trajectories()), plain.update(fake_trajectories())
    assert m_scaled["test/scale"] == 2.0
    assert m_scaled["loss/pg"] == pytest.approx(2 * m_plain["loss/pg"])


def test_bad_algorithm_config_is_one_line_naming_the_key():
    cases = {
        "algorithm.loss=gspoo": "algorithm.loss: unknown policy loss 'gspoo'; valid: cispo, dppo, dual_clip, gspo",
        "algorithm.advantage=rlooo": "algorithm.advantage: unknown advantage estimator 'rlooo'; valid: dr_",
        "algorithm.loss.kwargs={c: 0.5}": "algorithm.loss.kwargs.c: not a parameter of policy loss 'ppo_cl",
        "algorithm.advantage.kwargs={group_ids: 1}": "algorithm.advantage.kwargs.group_ids: set by the fra",
        "algorithm.regularisers.kl_in=both": "algorithm.regularisers.kl_in: Input should be 'loss' or 'reward'",
        "algorithm.shaping.overlong_buffer=9": "algorithm.shaping.overlong_buffer: 9 is longer than rollout.max_",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(SMOKE, [override])
        text = str(err.value)
        assert message in text and "\n" not in text, (override, text)
    with pytest.raises(ConfigError, match=r"algorithm.loss.kwargs: policy loss 'dual_clip' rejected .*c > 1"):
        load_config(SMOKE, ["algorithm.loss=dual_clip", "algorithm.loss.kwargs={c: 0.5}"])
    with pytest.raises(ConfigError, match=r"algorithm.sampling.dynamic: needs rollout.group_size >= 2"):
        load_config(SMOKE, ["algorithm.sampling.dynamic=true", "rollout.group_size=1"])
    ok = load_config(SMOKE, ["algorithm.loss=dual_clip", "algorithm.loss.kwargs={c: 2}"])
    assert ok.algorithm.loss.kwargs == {"c": 2}


def test_kl_in_the_reward_makes_per_token_advantages():
    # A = 1, k1 KL per token = logp - ref = [0.1, 0.2, 0.3], coef 0.5: to-go [0.6, 0.5, 0.3]
    # -> advantages 1 - 0.5 * to-go = [0.7, 0.75, 0.85]
    learner = make_learner(regularisers={"kl_coef": 0.5, "kl_in": "reward", "kl_estimator": "k1"})
    batch = collate(fake_trajectories(1), pad_id=2)
    batch.advantages = torch.tensor([1.0])
    old, ref = torch.zeros(1, 3), torch.tensor([[-0.1, -0.2, -0.3]])
    no_cross = torch.tensor([False])
    adv, _, _, returns, _, _ = token_advantages(learner.algo, batch, torch.tensor([1.0]), old, ref, None, no_cross, 2.0,
                                             1.0)
    assert adv[0].tolist() == pytest.approx([0.7, 0.75, 0.85]) and returns is None
    # in the loss instead: advantages stay per sequence
    in_loss = make_learner(regularisers={"kl_coef": 0.5, "kl_in": "loss", "kl_estimator": "k1"})
    adv = token_advantages(in_loss.algo, batch, torch.tensor([1.0]), old, ref, None, no_cross, 2.0, 1.0).advantages
    assert adv.tolist() == [1.0]


@pytest.mark.slow
def test_kl_placement_changes_the_update():
    # The first update moves the policy away from the reference; the second sees KL > 0 either way.
    results = {}
    for where in ("loss", "reward"):
        learner = make_learner(lr=1e-2, regularisers={"kl_coef": 1.0, "kl_in": where})
        learner.update(fake_trajectories())
        results[where] = learner.update(fake_trajectories())
        assert results[where]["kl"] > 0
    assert results["loss"]["loss"] != pytest.approx(results["reward"]["loss"])


@pytest.mark.slow
def test_several_epochs_move_the_importance_ratio():
    m = make_learner(lr=1e-2, loss={"epochs": 3}, regularisers={"track_kl": False}).update(fake_trajectories())
    assert m["ratio/max"] > 1.0 or m["ratio/min"] < 1.0
    assert m["ratio/min"] <= m["ratio/mean"] <= m["ratio/max"]
    one = make_learner(lr=1e-2, loss={"epochs": 1}, regularisers={"track_kl": False}).update(fake_trajectories())
    assert one["ratio/min"] == pytest.approx(1.0) and one["ratio/max"] == pytest.approx(1.0)
