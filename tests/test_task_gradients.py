"""Per-task gradients: PCGrad and the gradient metrics against hand-worked numbers, and the learner's passes
per task adding up to its plain update."""

import math

import pytest
import torch
from algo_helpers import fake_trajectories

from polyrl.config import AlgorithmConfig, OptimConfig
from polyrl.learner.learner import Learner
from polyrl.learner.task_gradients import gradient_metrics, pcgrad
from polyrl.models.loading import tiny_random_model


def dot(a, b):
    return float(torch.dot(a, b))


def test_pcgrad_projects_conflicting_gradients_by_hand():
    g1, g2 = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])
    # g1 . g2 = -1 < 0: g1 -> g1 - (-1 / 2) g2 = [0.5, 0.5]; g2 -> g2 - (-1 / 1) g1 = [0, 1]; sum [0.5, 1.5]
    assert pcgrad([g1, g2], dot).tolist() == pytest.approx([0.5, 1.5])
    # no conflict: the plain sum
    assert pcgrad([g1, torch.tensor([1.0, 1.0])], dot).tolist() == pytest.approx([2.0, 1.0])
    # three tasks, order matters only through the projected vector: g3 = [0, -1] conflicts with g2 only
    g3 = torch.tensor([0.0, -1.0])
    # g1: vs g2 -> [0.5, 0.5]; vs g3: [0.5, 0.5] . [0, -1] = -0.5 -> + 0.5 [0, -1] ... = [0.5, 0]
    # g2: vs g1 -> [0, 1]; vs g3: -1 -> [0, 1] - 1 * [0, -1] = [0, 0]
    # g3: vs g1: 0 (no conflict); vs g2: -1 -> [0, -1] + 0.5 [-1, 1] = [-0.5, -0.5]
    assert pcgrad([g1, g2, g3], dot).tolist() == pytest.approx([0.0, -0.5])


def test_gradient_metrics_norms_and_cosines():
    m = gradient_metrics(["a", "b", "c"], [torch.tensor([3.0, 4.0]), torch.tensor([-4.0, 3.0]),
                                          torch.tensor([-3.0, -4.0])], dot)
    assert m["task_grad/norm/a"] == 5.0 and m["task_grad/norm/b"] == 5.0
    assert m["task_grad/cos/a/b"] == 0.0 and m["task_grad/cos/a/c"] == -1.0
    assert m["task_grad/cos/b/c"] == pytest.approx((12 - 12) / 25)


def _two_task_trajectories():
    ts = fake_trajectories(4)
    more = fake_trajectories(4)
    for t in more:
        t.task, t.group_id, t.item_id = "u", 1, 1
        t.input_ids = [8, 9, *t.input_ids[3:]]
        t.loss_mask, t.logprobs, t.versions = [0, 0, 1, 1, 1], [0.0] * 5, [-1] * 5
        t.advantage = -t.advantage  # the other task rewards the opposite answers: the gradients conflict
    return ts + more


def _learner(**algo):
    model = tiny_random_model(seed=0, vocab_size=64)
    algo_cfg = AlgorithmConfig(regularisers={"track_kl": False}, **algo)
    return Learner(model, algo_cfg, OptimConfig(lr=1e-3, micro_batch_size=3), 1.0, False, pad_id=2)


def test_passes_per_task_add_up_to_the_plain_update():
    plain, per_task = _learner(), _learner(gradients={"task_grad_every": 1})
    m_plain = plain.update(_two_task_trajectories())
    m_task = per_task.update(_two_task_trajectories())
    assert m_task["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    assert m_task["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    assert m_task["mismatch/kl"] == pytest.approx(m_plain["mismatch/kl"], rel=1e-5)
    for a, b in zip(plain.model.parameters(), per_task.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert "task_grad/cos/t/u" in m_task and "task_grad/cos/t/u" not in m_plain
    assert -1.0 <= m_task["task_grad/cos/t/u"] <= 1.0 and m_task["task_grad/norm/t"] > 0
    # every k steps: step 0 and 2 log them with k = 2, step 1 does not
    every2 = _learner(gradients={"task_grad_every": 2})
    logged = ["task_grad/norm/u" in every2.update(_two_task_trajectories()) for _ in range(3)]
    assert logged == [True, False, True]


def test_pcgrad_changes_the_update_only_when_tasks_conflict():
    plain, surgery = _learner(), _learner(gradients={"surgery": "pcgrad"})
    m_plain, m_pc = plain.update(_two_task_trajectories()), surgery.update(_two_task_trajectories())
    assert m_pc["task_grad/cos/t/u"] < 0  # opposite advantages on similar answers
    # the projection removes the conflicting components, so the summed gradient differs
    assert not math.isclose(m_pc["grad_norm"], m_plain["grad_norm"], rel_tol=1e-3)
    # one task only: nothing to project, the plain update
    one_a, one_b = _learner(), _learner(gradients={"surgery": "pcgrad"})
    assert one_b.update(fake_trajectories())["grad_norm"] == pytest.approx(
        one_a.update(fake_trajectories())["grad_norm"], rel=1e-6)


def test_gradient_surgery_name_is_checked():
    with pytest.raises(ValueError, match="gradients.surgery"):
        AlgorithmConfig(gradients={"surgery": "mgda"})
