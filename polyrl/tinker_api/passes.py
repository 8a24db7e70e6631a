"""Log-probs of Tinker datums through polyrl's learner pass.

A Tinker loss reads every position of a datum, but in the cookbook's data most positions carry no gradient:
the prompt's weights and advantages are zero, and the G samples of a group repeat one prompt. So each datum
is split where its gradient starts (``start``: the first position whose weight is not zero) and laid out as
polyrl's learner lays out a trajectory, [prompt | response] (``learner/batch.Batch``): ``response_hidden``
runs each distinct prompt once and the float32 output head runs, with gradients, on the positions from
``start`` on. The positions before it are scored without gradients, once per distinct prompt and targets.
Nothing changes in the numbers: the positions left out of the backward pass contribute zero to it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from polyrl.learner.batch import Batch
from polyrl.learner.forward_pass import response_hidden
from polyrl.learner.logprobs import chunked_logprobs, response_token_logprobs
from polyrl.models.forward import decoder_forward
from polyrl.tinker_api.wire import Datum

TOKENS_PER_PASS = 8192
"""Padded tokens per pass; a larger batch runs as several passes whose gradients add up (the loss is a sum, so
this changes nothing but the peak memory)."""


def start(datum: Datum, weight: str | None) -> int:
    """The first position with a gradient: where ``weight`` is first nonzero (the last position if nowhere;
    0 when every position may have one)."""
    if weight is None:
        return 0
    nonzero = datum.inputs[weight].nonzero()
    return int(nonzero[0]) if len(nonzero) else len(datum.tokens) - 1


def passes(data: list[Datum]) -> list[list[int]]:
    """Indices of consecutive datums grouped so a pass pads to at most ``TOKENS_PER_PASS`` tokens."""
    parts: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i, datum in enumerate(data):
        new_width = max(width, len(datum.tokens))
        if current and new_width * (len(current) + 1) > TOKENS_PER_PASS:
            parts.append(current)
            current, new_width = [], len(datum.tokens)
        current.append(i)
        width = new_width
    parts.append(current)
    return parts


def layout(data: list[Datum], starts: list[int], pad_id: int) -> Batch:
    """Datum i as a trajectory whose prompt is its tokens up to and including ``starts[i]`` and whose response
    is the rest plus one filler token (the last position predicts nothing in polyrl's layout); the targets of
    response position j are the datum's targets from ``starts[i]`` on."""
    prompts = [d.tokens[: s + 1] for d, s in zip(data, starts, strict=True)]
    targets = [d.inputs["target_tokens"][s:] for d, s in zip(data, starts, strict=True)]
    responses = [d.tokens[s + 1 :] + [int(t[-1])] for d, s, t in zip(data, starts, targets, strict=True)]
    left, right = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(data), left + right), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target_ids = torch.zeros((len(data), right), dtype=torch.long)
    for i, (prompt, response, target) in enumerate(zip(prompts, responses, targets, strict=True)):
        ids[i, left - len(prompt) : left + len(response)] = torch.tensor(prompt + response)
        mask[i, left - len(prompt) : left + len(response)] = 1
        target_ids[i, : len(target)] = target
    zeros = torch.zeros((len(data), right))
    none = torch.zeros(len(data), dtype=torch.bool)
    return Batch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 targets=target_ids, loss_mask=zeros, behaviour_logp=zeros, advantages=torch.zeros(len(data)),
                 replayed=none, guided=none)


@torch.no_grad()
def _prefix_logprobs(model: PreTrainedModel, data: list[Datum], starts: list[int], bf16: bool) -> list[torch.Tensor]:
    """Log-probs of each datum's positions before its start, computed once per distinct (tokens, targets)."""
    rows: dict[tuple, list[int]] = {}
    for i, (d, s) in enumerate(zip(data, starts, strict=True)):
        if s > 0:
            rows.setdefault((tuple(d.tokens[:s]), tuple(d.inputs["target_tokens"][:s].tolist())), []).append(i)
    out = [torch.zeros(0) for _ in data]
    if not rows:
        return out
    keys = list(rows)
    width = max(len(tokens) for tokens, _ in keys)
    ids = torch.zeros((len(keys), width), dtype=torch.long)
    targets, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for u, (tokens, target) in enumerate(keys):
        ids[u, : len(tokens)], targets[u, : len(tokens)], mask[u, : len(tokens)] = (
            torch.tensor(tokens), torch.tensor(target), 1)
    device = next(model.parameters()).device
    ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
    hidden, _ = decoder_forward(model, ids, mask, torch.arange(width, device=device).expand_as(ids), bf16)
    logprobs, _ = chunked_logprobs(model, hidden, targets, 1.0)
    for u, (tokens, _) in enumerate(keys):
        for i in rows[keys[u]]:
            out[i] = logprobs[u, : len(tokens)]
    return out


def datum_logprobs(model: PreTrainedModel, data: list[Datum], starts: list[int], bf16: bool, pad_id: int,
                   grad: bool) -> list[torch.Tensor]:
    """Each datum's log-probs of its targets, one per position (differentiable from its start when ``grad``)."""
    batch = layout(data, starts, pad_id).to(next(model.parameters()).device)
    with torch.set_grad_enabled(grad):
        # the head on the datums' own positions (not the layout's padding), as the learner's pass runs it
        tail, _ = response_token_logprobs(model, response_hidden(model, batch, bf16), batch, 1.0, bf16_backward=bf16)
    head = _prefix_logprobs(model, data, starts, bf16)
    return [torch.cat([h.to(tail.device), tail[i, : len(d.tokens) - s]])
            for i, (d, s, h) in enumerate(zip(data, starts, head, strict=True))]
