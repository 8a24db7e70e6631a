"""The learner's loss terms on a micro-batch worked out by hand, and the resume point shared by RL and SFT."""

import dataclasses
import math

import pytest
import torch
from algo_helpers import fake_trajectories

from polyrl.checkpoint.store import checkpoint_to_resume
from polyrl.config import AlgorithmConfig
from polyrl.learner.advantage_stage import TokenAdvantages
from polyrl.learner.batch import collate
from polyrl.learner.loss_terms import (
    LOSS_TERMS,
    LossInputs,
    distill_term,
    entropy_term,
    guidance_term,
    kl_term,
    policy_term,
    success_sft_term,
    value_term,
)


def _inputs(share: float = 1.0) -> LossInputs:
    # Two rows of three response tokens; the policy equals the policy at the update's start (ratio 1) and puts
    # probability 1 / 4 on each token where the reference puts 1 / 2; every token's entropy is 0.5.
    mb = collate(fake_trajectories(2), pad_id=2)
    logp = torch.full((2, 3), math.log(0.25))
    advantages = TokenAdvantages(torch.tensor([1.0, 2.0]), mb.loss_mask, logp.clone(), None, {})
    return LossInputs(mb, logp, torch.full((2, 3), 0.5), None, None, torch.full((2, 3), math.log(0.5)), None,
                      advantages, None, None, num_tokens=6.0, share=share)


def test_each_term_worked_by_hand():
    algo = AlgorithmConfig(loss={"pg_coef": 0.5},
                           regularisers={"entropy_coef": 0.1, "kl_coef": 0.2, "kl_estimator": "k1"})
    x = _inputs()
    # PPO-clip at ratio 1: -(3 x 1 + 3 x 2) / 6 = -1.5 per token, times pg_coef 0.5
    pg = policy_term(algo, x)
    assert float(pg.loss) == pytest.approx(-0.75) and pg.logged == {"loss/pg": pytest.approx(-1.5)}
    ent = entropy_term(algo, x)  # a bonus: -0.1 x 0.5
    assert float(ent.loss) == pytest.approx(-0.05) and ent.logged == {"entropy": pytest.approx(0.5)}
    kl = kl_term(algo, x)  # k1 = log(1/4) - log(1/2) = -log 2 on every token, times kl_coef 0.2
    assert float(kl.loss) == pytest.approx(-0.2 * math.log(2)) and kl.logged == {"kl": pytest.approx(-math.log(2))}
    # without a critic or a teacher those terms are absent
    assert value_term(algo, x).loss is None and distill_term(algo, x).loss is None
    assert guidance_term(algo, x).loss is None  # no reference rows
    assert success_sft_term(algo, x).loss is None  # sft_coef 0
    assert (policy_term, guidance_term, success_sft_term, entropy_term, distill_term, kl_term, value_term) == LOSS_TERMS
    total = sum(t.loss for t in (term(algo, x) for term in LOSS_TERMS) if t.loss is not None)
    assert float(total) == pytest.approx(-0.75 - 0.05 - 0.2 * math.log(2))


def test_kl_in_the_reward_is_measured_not_added_and_share_weights_every_term():
    algo = AlgorithmConfig(regularisers={"kl_coef": 0.2, "kl_in": "reward", "kl_estimator": "k1", "entropy_coef": 0.1})
    half = _inputs(share=0.5)
    kl = kl_term(algo, half)
    assert kl.loss is None and kl.logged == {"kl": pytest.approx(-0.5 * math.log(2))}
    assert float(policy_term(algo, half).loss) == pytest.approx(0.5 * -1.5)
    assert float(entropy_term(algo, half).loss) == pytest.approx(-0.1 * 0.25)


def test_resume_point_skips_partial_saves_and_says_when_there_is_none(tmp_path):
    partial = tmp_path / "checkpoints" / ".step-3.tmp"
    partial.mkdir(parents=True)
    said = []
    assert checkpoint_to_resume(tmp_path, log=said.append) is None
    assert not partial.exists() and said == [f"{tmp_path}: no usable checkpoint to resume from; starting from step 0"]
    partial.mkdir()
    checkpoint_to_resume(tmp_path, clean=False, log=said.append)  # a rank that does not own the run
    assert partial.exists()


@pytest.mark.parametrize(("agg", "want"), [
    # row 0 succeeded (reward 1), row 1 did not: only row 0's three tokens count, each -log(1/4) = log 4.
    ("token-mean", 3 * math.log(4) / 6),  # over every loss token of the batch (6)
    ("seq-mean-token-mean", (math.log(4) + 0.0) / 2),  # row 0's mean, row 1's zero, over the two rows
    ("seq-mean-token-sum", (3 * math.log(4) + 0.0) / 2),
])
def test_sft_on_successes_counts_only_rows_at_the_reward_threshold(agg, want):
    algo = AlgorithmConfig(loss={"agg": agg}, regularisers={"sft_coef": 0.5, "sft_min_reward": 1.0})
    x = dataclasses.replace(_inputs(), rewards=torch.tensor([1.0, 0.0]))
    term = success_sft_term(algo, x)
    assert float(term.loss) == pytest.approx(0.5 * want)
    assert term.logged == {"loss/sft": pytest.approx(want)} and term.metrics == {"sft/success_share": 0.5}
    # a higher bar leaves no success: the term is zero, not absent (the weight is on)
    higher = AlgorithmConfig(loss={"agg": agg}, regularisers={"sft_coef": 0.5, "sft_min_reward": 1.5})
    none = success_sft_term(higher, x)
    assert float(none.loss) == 0.0 and none.metrics == {"sft/success_share": 0.0}
