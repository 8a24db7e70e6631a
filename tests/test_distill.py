"""The on-policy distillation loss against hand-computed numbers, and its use by the learner."""

import math

import pytest
import torch

from polyrl.algorithms.distill import reverse_kl_loss, reverse_kl_per_token


def test_reverse_kl_matches_hand_computed_values():
    # Two-token vocabulary. Position 0: student p = (0.5, 0.5), teacher q = (0.8, 0.2):
    #   KL(p||q) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 (-0.470004) + 0.5 (0.916291) = 0.223144
    # Position 1: student = teacher, KL = 0. Position 2: student (0.9, 0.1), teacher (0.5, 0.5):
    #   0.9 ln(1.8) + 0.1 ln(0.2) = 0.9 (0.587787) + 0.1 (-1.609438) = 0.368064
    student = torch.log(torch.tensor([[[0.5, 0.5], [0.3, 0.7], [0.9, 0.1]]]))
    teacher = torch.log(torch.tensor([[[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]]]))
    per_token = reverse_kl_per_token(student, teacher)
    assert per_token[0].tolist() == pytest.approx([0.223144, 0.0, 0.368064], abs=1e-5)
    # Reverse, not forward: KL(q||p) at position 0 is 0.8 ln 1.6 + 0.2 ln 0.4 = 0.192745, a different number.
    assert float(per_token[0, 0]) != pytest.approx(0.192745, abs=1e-3)


def test_loss_masks_and_aggregates_like_the_policy_losses():
    student = torch.log(torch.tensor([[[0.5, 0.5], [0.3, 0.7], [0.9, 0.1]]]))
    teacher = torch.log(torch.tensor([[[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding / env tokens
    loss, metrics = reverse_kl_loss(student, teacher, mask, "token-mean")
    assert float(loss) == pytest.approx(0.223144 / 2, abs=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(0.223144 / 2, abs=1e-5)
    # A shared global token count (micro-batches) divides the sum instead.
    loss, _ = reverse_kl_loss(student, teacher, mask, "token-mean", num_tokens=4.0)
    assert float(loss) == pytest.approx(0.223144 / 4, abs=1e-5)


def test_gradient_reaches_the_student_only_and_vanishes_at_the_teacher():
    student = torch.tensor([[[1.0, -1.0, 0.5]]], requires_grad=True)
    teacher = torch.tensor([[[0.0, 0.0, 2.0]]], requires_grad=True)
    loss, _ = reverse_kl_loss(student, teacher, torch.ones(1, 1))
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
    # Analytic gradient of KL(softmax(s) || softmax(t)) w.r.t. s: p * (log p - log q - KL).
    p = torch.softmax(student.detach(), -1)
    log_ratio = torch.log_softmax(student.detach(), -1) - torch.log_softmax(teacher.detach(), -1)
    expected = p * (log_ratio - (p * log_ratio).sum(-1, keepdim=True))
    assert torch.allclose(student.grad, expected, atol=1e-6)
    same = torch.tensor([[[0.3, 0.1, -0.2]]], requires_grad=True)
    loss, _ = reverse_kl_loss(same, same.detach().clone(), torch.ones(1, 1))
    loss.backward()
    assert math.isclose(float(loss.detach()), 0.0, abs_tol=1e-7) and same.grad.abs().max() < 1e-6


@pytest.mark.slow
def test_learner_distills_each_row_from_its_own_task_teacher():
    from polyrl.config import AlgorithmConfig, OptimConfig
    from polyrl.learner.learner import Learner
    from polyrl.models.loading import tiny_random_model
    from polyrl.types import Trajectory

    student, teacher = tiny_random_model(0, vocab_size=64), tiny_random_model(1, vocab_size=64)
    algo = AlgorithmConfig(loss={"pg_coef": 0.0}, regularisers={"distill_coef": 1.0, "track_kl": False})
    rows = [
        Trajectory(task=task, item_id=i, group_id=i, input_ids=[5, 6, 7, 8 + i], loss_mask=[0, 0, 1, 1],
                   logprobs=[0.0] * 4, versions=[-1, -1, 0, 0])
        for i, task in enumerate(["taught", "taught", "untaught"])
    ]
    learner = Learner(student, algo, OptimConfig(lr=1e-2), 1.0, False, 0, teachers={"taught": teacher})
    first = learner.update(rows)
    assert first["distill/reverse_kl"] > 0 and first["loss/distill"] > 0
    for _ in range(5):
        last = learner.update(rows)
    assert last["distill/reverse_kl"] < first["distill/reverse_kl"]  # the student moves toward its teacher
    # The untaught task's rows alone give no distillation loss.
    alone = learner.update(rows[2:])
    assert alone["loss/distill"] == 0.0
