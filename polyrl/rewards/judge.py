"""LLM-as-judge rewards: a local causal LM scores a response by the probability it answers "yes" to a
rubric question about it (Zheng et al. 2023, "Judging LLM-as-a-Judge", single-answer grading; reading the
verdict's token probability rather than sampling it gives a graded, deterministic reward).

The score is P(yes) / (P(yes) + P(no)) at the first token of the judge's reply, summed over the spellings of
each word that are single tokens, so it lies in [0, 1] and does not depend on other tokens' mass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyrl.models.device import module_device
from polyrl.models.loading import load_model, load_tokenizer

TEMPLATE = "Question:\n{question}\n\nResponse:\n{response}\n\n{rubric} Answer with yes or no."
REFERENCE_TEMPLATE = ("Question:\n{question}\n\nReference answer:\n{reference}\n\nResponse:\n{response}\n\n"
                      "{rubric} Answer with yes or no.")


def verdict_token_ids(tokenizer, word: str) -> list[int]:
    """Ids of the single-token spellings of ``word`` (lower, capitalised, with a leading space)."""
    ids = set()
    for form in (word, word.capitalize(), " " + word, " " + word.capitalize()):
        enc = tokenizer.encode(form, add_special_tokens=False)
        if len(enc) == 1:
            ids.add(enc[0])
    if not ids:
        raise ValueError(f"judge tokenizer has no single-token spelling of '{word}'")
    return sorted(ids)


class Judge:
    """A frozen local model that grades (question, response) pairs against a rubric."""

    def __init__(
        self, model_name: str, seed: int = 0, batch_size: int = 16, device: torch.device | str | None = None
    ) -> None:
        """``device``: where the judge runs (the policy's, ``train.device``); None keeps it on the CPU."""
        self.name = model_name
        self.tokenizer = load_tokenizer(model_name)
        self.model = load_model(model_name, None, seed=seed, device=device).eval().requires_grad_(False)
        self.device = module_device(self.model)
        self.batch_size = batch_size
        self.yes = verdict_token_ids(self.tokenizer, "yes")
        self.no = verdict_token_ids(self.tokenizer, "no")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    def prompt_ids(self, question: str, response: str, rubric: str, reference: str | None = None) -> list[int]:
        """The chat-formatted judge prompt; with ``reference``, the reference answer is shown before the
        response (grading against a reference, Zheng et al. 2023's reference-guided grading)."""
        if reference is None:
            text = TEMPLATE.format(question=question, response=response, rubric=rubric)
        else:
            text = REFERENCE_TEMPLATE.format(question=question, reference=reference, response=response,
                                             rubric=rubric)
        messages = [{"role": "user", "content": text}]
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    @torch.no_grad()
    def score(
        self, pairs: Sequence[tuple[str, str]], rubric: str, references: Sequence[str] | None = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) for each (question, response) pair, against its reference if given."""
        scores: list[float] = []
        refs = list(references) if references is not None else [None] * len(pairs)
        for start in range(0, len(pairs), self.batch_size):
            chunk = zip(pairs[start : start + self.batch_size], refs[start : start + self.batch_size], strict=True)
            prompts = [self.prompt_ids(q, r, rubric, ref) for (q, r), ref in chunk]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):  # left padding: every row's last token is in the last column
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            if self.device.type != "cpu":
                ids, mask, positions = (t.to(self.device, non_blocking=True) for t in (ids, mask, positions))
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            yes = torch.logsumexp(logp[:, self.yes], dim=-1)
            no = torch.logsumexp(logp[:, self.no], dim=-1)
            scores += torch.sigmoid(yes - no).tolist()  # = p_yes / (p_yes + p_no)
        return scores
