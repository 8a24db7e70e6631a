"""Teachers for on-policy distillation: one frozen model per distinct ``tasks[].teacher``, loaded once."""

from __future__ import annotations

from transformers import PreTrainedModel

from polyrl.config import Config
from polyrl.models.device import module_device
from polyrl.models.loading import load_model


def load_teachers(config: Config, student: PreTrainedModel) -> dict[str, PreTrainedModel]:
    """Task name -> its teacher (eval mode, no grad); tasks sharing a teacher share one model.

    Empty when ``algorithm.regularisers.distill_coef`` is 0, so ordinary runs load nothing. A teacher must share
    the student's vocabulary, since the loss compares the two distributions token by token.
    """
    if config.algorithm.regularisers.distill_coef <= 0:
        return {}
    vocab = student.get_output_embeddings().weight.shape[0]
    device = module_device(student)  # the learner runs teacher and student on the same batch
    loaded: dict[str, PreTrainedModel] = {}
    teachers: dict[str, PreTrainedModel] = {}
    for i, task in enumerate(config.tasks):
        if task.teacher is None:
            continue
        if task.teacher not in loaded:
            model = load_model(task.teacher, None, seed=config.train.seed, device=device)
            model = model.eval().requires_grad_(False)
            size = model.get_output_embeddings().weight.shape[0]
            if size != vocab:
                raise ValueError(
                    f"tasks.{i}.teacher: '{task.teacher}' has a vocabulary of {size} tokens, the student {vocab}; "
                    "distillation needs the same tokenizer"
                )
            loaded[task.teacher] = model
        teachers[task.name] = loaded[task.teacher]
    return teachers
