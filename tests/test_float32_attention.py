"""models/forward.py: under bf16 autocast on a CPU, attention over several positions runs in float32 with the
same masks as SDPA (padding stays unseen), close to the bf16 SDPA it replaces; float32 models are unchanged."""

from __future__ import annotations

import torch

from polyrl.models.forward import FLOAT32_SDPA
from polyrl.models.loading import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def padded_logits(model, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the left-padded batch at the short row's tokens, and of that row alone."""
    ids = torch.tensor([PROMPTS[0], [0, 0, 0, *PROMPTS[1]]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[1, 3:].float()
        alone = model(input_ids=torch.tensor([PROMPTS[1]])).logits[0].float()
    return batch, alone


def test_float32_attention_masks_padding_and_stays_close_to_bf16_sdpa(monkeypatch):
    model = load_model("tiny-random")
    assert model.config._attn_implementation == FLOAT32_SDPA
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):  # what the kernel will compute in: autocast would cast to bf16
        seen.append((q.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ours, alone = padded_logits(model, autocast=True)
    assert seen and set(seen) == {(torch.float32, torch.float32, False)}  # bf16 autocast, attention float32
    scale = alone.abs().max()
    assert (ours - alone).abs().max() < 0.02 * scale  # padding masked: the padded row is the row alone
    model.set_attn_implementation("sdpa")
    seen.clear()
    theirs, _ = padded_logits(model, autocast=True)
    assert all(autocast for _, _, autocast in seen)  # plain SDPA: autocast runs it in bf16
    assert (ours - theirs).abs().max() < 0.02 * scale  # bf16 rounding apart, the same computation


def test_the_switch_leaves_plain_sdpa():
    assert load_model("tiny-random", float32_attention=False).config._attn_implementation == "sdpa"


def test_float32_models_take_the_plain_path():
    model = load_model("tiny-random")
    ours, alone = padded_logits(model, autocast=False)
    model.set_attn_implementation("sdpa")
    theirs, _ = padded_logits(model, autocast=False)
    assert torch.equal(ours, theirs)
    assert torch.allclose(ours, alone, atol=1e-4)
