"""Batches the learner trains on: trajectories laid out as [left-padded prompt | right-padded response], so
the output head runs only on response positions and every sequence's first model token sits in the same
column."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.types import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, R] token ids at response positions
    loss_mask: torch.Tensor  # [B, R]
    behaviour_logp: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B], or [B, R] when some trajectory has token_advantages
    replayed: torch.Tensor  # [B] bool: stored samples whose behaviour log-probs come from an older policy
    guided: torch.Tensor  # [B] bool: reference replies no policy sampled (guidance)

    @property
    def response_len(self) -> int:
        return self.targets.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """This batch with every tensor on ``device`` (itself when they are all there already). Copies to a GPU
        are queued without the host waiting (``non_blocking``); copies back to the host always wait, since
        a non-blocking one could be read before it lands."""
        device = torch.device(device)
        non_blocking = non_blocking and device.type != "cpu"
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if all(t.device == device for t in fields.values()):
            return self
        return Batch(**{f: t.to(device, non_blocking=non_blocking) for f, t in fields.items()})

    def rows(self, idx: slice) -> Batch:
        """The rows ``idx``, with the columns that are padding in every one of them cut away. On a GPU this
        reads the rows' column usage back once; slicing a host batch before ``to`` avoids even that."""
        sub = Batch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))
        s = sub.input_ids.shape[1] - sub.response_len
        used = sub.attention_mask.bool().any(dim=0).cpu()
        left = int(used[:s].float().argmax()) if s else 0  # first prompt column any row uses
        right = int(used[s:].nonzero().max()) + 1 if used[s:].any() else 1  # response columns in use
        return Batch(
            input_ids=sub.input_ids[:, left : s + right],
            attention_mask=sub.attention_mask[:, left : s + right],
            position_ids=sub.position_ids[:, left : s + right],
            targets=sub.targets[:, :right],
            loss_mask=sub.loss_mask[:, :right],
            behaviour_logp=sub.behaviour_logp[:, :right],
            advantages=sub.advantages[:, :right] if sub.advantages.dim() == 2 else sub.advantages,
            replayed=sub.replayed,
            guided=sub.guided,
        )


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    starts = [t.prompt_len for t in trajectories]
    width_left = max(starts)
    width_right = max(len(t.input_ids) - s for t, s in zip(trajectories, starts, strict=True))
    b, length = len(trajectories), width_left + width_right
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, width_right), dtype=torch.float32)
    behaviour = torch.zeros((b, width_right), dtype=torch.float32)
    for i, (t, s) in enumerate(zip(trajectories, starts, strict=True)):
        n_resp = len(t.input_ids) - s
        lo, hi = width_left - s, width_left + n_resp
        input_ids[i, lo:hi] = torch.tensor(t.input_ids)
        attn[i, lo:hi] = 1
        loss_mask[i, :n_resp] = torch.tensor(t.loss_mask[s:], dtype=torch.float32)
        behaviour[i, :n_resp] = torch.tensor(t.logprobs[s:], dtype=torch.float32)
        if t.info.get("parent_id") is not None:
            # An ARPO branch's copied prefix is trained once, in the leaf it was generated in (which carries
            # the attributed advantage); counting it again per leaf would weight shared tokens by their copies.
            loss_mask[i, : max(0, int(t.info["branch_at"]) - s)] = 0.0
    if any(t.token_advantages is not None for t in trajectories):
        advantages = torch.zeros((b, width_right), dtype=torch.float32)
        for i, (t, s) in enumerate(zip(trajectories, starts, strict=True)):
            per_token = t.token_advantages or [t.advantage] * len(t.input_ids)
            advantages[i, : len(t.input_ids) - s] = torch.tensor(per_token[s:], dtype=torch.float32)
    else:
        advantages = torch.tensor([t.advantage for t in trajectories], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        targets=input_ids[:, width_left:],
        loss_mask=loss_mask,
        behaviour_logp=behaviour,
        advantages=advantages,
        replayed=torch.tensor([t.replayed for t in trajectories], dtype=torch.bool),
        guided=torch.tensor([t.guided for t in trajectories], dtype=torch.bool),
    )
