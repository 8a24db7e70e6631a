"""On-policy distillation: the student samples, and is pulled toward a teacher on its own samples.

Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", Eq. 2 with lambda = 1, i.e. student-generated data, and the reverse
KL of their Sec. 3) minimises, at every position t of a sequence y sampled from the student,

    D_KL(p_S(. | y_<t) || p_T(. | y_<t)) = sum_v p_S(v) (log p_S(v) - log p_T(v)),

the full-vocabulary reverse KL (mode-seeking: the student is penalised for putting mass where the teacher
puts none). With a different teacher per task this is multi-teacher on-policy distillation (MOPD, the
merging step of Nemotron-Cascade's cascaded RL), which the learner does by giving each row its task's teacher.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.losses import aggregate, masked_mean


def reverse_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) at each position over the vocabulary: [B, T, V] logits -> [B, T].

    Gradients flow into the student only; the teacher's logits are treated as constants.
    """
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def reverse_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GKD's on-policy reverse-KL objective (Agarwal et al. 2024), reduced like the policy losses.

    ``mask`` [B, T] is 1 on the student's own tokens that have a teacher; ``agg`` and ``num_tokens`` are as
    in ``losses.aggregate``. Metrics: ``distill/reverse_kl``, the mean per-token KL over masked positions.
    """
    per_token = reverse_kl_per_token(student_logits, teacher_logits)
    loss = aggregate(per_token, mask, agg, num_tokens)
    return loss, {"distill/reverse_kl": masked_mean(per_token.detach(), mask)}
