"""models/packed_attention.py: a packed row's attention one segment at a time equals the dense mask's, forward
and backward; the learner uses it where it is cheaper, through checkpointed layers and bf16 autocast, and falls
back to the dense mask for layers that do not pass the layout on."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from polyrl.learner import forward_pass
from polyrl.learner.batch import collate
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.forward import enable_activation_checkpointing, use_float32_attention
from polyrl.models.loading import tiny_random_model
from polyrl.models.packed_attention import packed_segments, segment_attention, segment_work
from polyrl.types import Trajectory


def test_layout_of_a_prompt_and_two_responses():
    # Row: prompt at 0..2, response A at 3..4, response B at 5; a response sees its prompt and itself, causally.
    layout = packed_segments([(0, 3, 0, 0), (3, 2, 0, 3), (5, 1, 0, 3)], 6)
    assert layout.queries.tolist() == [[0, 1, 2], [3, 4, 0], [5, 0, 0]]
    assert layout.keys.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 1, 2, 5, 0]]
    assert layout.allowed[:, 0].int().tolist() == [
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]],  # the padding query sees key 0 only
        [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]],
    ]
    assert layout.outputs.tolist() == [0, 1, 2, 3, 4, 6]
    assert layout.queries.numel() * layout.keys.shape[1] == 3 * 3 * 5 == segment_work([3], [(3, 2), (3, 1)])


def test_positions_in_two_segments_or_none_are_refused():
    with pytest.raises(ValueError, match="position 2 is the query of two segments"):
        packed_segments([(0, 3, 0, 0), (2, 2, 0, 2)], 4)
    with pytest.raises(ValueError, match="position 3 is in no segment"):
        packed_segments([(0, 3, 0, 0)], 4)


class _Attention(torch.nn.Module):
    num_key_value_groups = 3  # 6 query heads over 2 key/value heads
    is_causal = True


def test_segments_equal_the_dense_mask_forward_and_backward():
    torch.manual_seed(0)
    # two prompts (4 and 3 tokens) with responses of 3, 1, 5 and 2 tokens
    spec = [(4, [3, 1]), (3, [5, 2])]
    segments, group, own = [], [], []
    for g, (prompt, responses) in enumerate(spec):
        start = len(group)
        segments.append((start, prompt, 0, 0))
        group += [g] * prompt
        own += [-1] * prompt
        for size in responses:
            segments.append((len(group), size, start, prompt))
            own += [len(segments)] * size
            group += [g] * size
    length = len(group)
    group, own = torch.tensor(group), torch.tensor(own)
    dense = torch.ones(length, length, dtype=torch.bool).tril_()
    dense &= (group[:, None] == group[None]) & ((own[None] == -1) | (own[None] == own[:, None]))
    layout = packed_segments(segments, length)
    q, k, v = (torch.randn(1, h, length, 8, requires_grad=True) for h in (6, 2, 2))
    upstream = torch.randn(1, length, 6, 8)
    outs = []
    for attend in (lambda: sdpa_attention_forward(_Attention(), q, k, v, dense[None, None])[0],
                   lambda: segment_attention(sdpa_attention_forward, _Attention(), q, k, v, layout)[0]):
        out = attend()
        grads = torch.autograd.grad(out, (q, k, v), upstream)
        outs.append((out, *grads))
    for a, b in zip(*outs, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5)
    assert layout.calls == [1]


def _model(seed):
    """The tiny model with polyrl's attention function, as ``load_model`` gives it (the one that reads layouts)."""
    model = tiny_random_model(seed=seed)
    assert use_float32_attention(model)
    return model


def _traj(prompt, response, group):
    ids = prompt + response
    return Trajectory(task="t", item_id=group, group_id=group, input_ids=ids,
                      loss_mask=[0] * len(prompt) + [1] * len(response), logprobs=[0.0] * len(ids),
                      versions=[0] * len(ids))


def _batch():
    p1, p2 = [5, 6, 7, 8, 9], [11, 12, 13]
    trajs = [_traj(p1, list(range(20, 29)), 0), _traj(p1, [23], 0), _traj(p1, [24, 25], 0),
             _traj(p2, [30, 31, 32, 33], 1), _traj(p2, [34, 35], 1), _traj(p2, [36, 37, 38, 39, 40, 41], 1)]
    return collate(trajs, pad_id=2)


def _logprobs_and_grads(model, batch, share, bf16=False):
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, batch, temperature=0.7, bf16=bf16, share_prefix=share)
    (logp * batch.loss_mask * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _layouts(monkeypatch):
    """Force the packed row with segments, and keep every layout the learner builds."""
    made = []
    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 10**9)
    monkeypatch.setattr(forward_pass, "SEGMENT_OVERHEAD", -(10**9))
    monkeypatch.setattr(forward_pass, "_segments_unused", set())
    build = forward_pass.packed_segments
    monkeypatch.setattr(forward_pass, "packed_segments", lambda *a: made.append(build(*a)) or made[-1])
    return made


@pytest.mark.parametrize("checkpointed,bf16", [(False, False), (True, False), (False, True)])
def test_learner_pass_uses_segments_and_matches_the_padded_pass(monkeypatch, checkpointed, bf16):
    model = _model(7)
    if checkpointed:
        enable_activation_checkpointing(model)
        model.train()
    batch, made = _batch(), _layouts(monkeypatch)
    segmented = _logprobs_and_grads(model, batch, share=True, bf16=bf16)
    layers = model.config.num_hidden_layers
    # every layer attended through the layout; checkpointed layers once more in the backward pass
    assert len(made) == 1 and made[0].calls == [layers * (2 if checkpointed else 1)]
    plain = _logprobs_and_grads(model, batch, share=False, bf16=bf16)
    mask = batch.loss_mask.bool()
    # under bf16 autocast any two layouts differ by bf16 roundings (the dense packed row's too): 1 % of the largest
    tol = 1e-2 if bf16 else 1e-5
    assert torch.allclose(segmented[0][mask], plain[0][mask], atol=tol)
    assert torch.allclose(segmented[1], plain[1], atol=tol * (plain[1].abs().max() if bf16 else 1))


def test_layers_that_drop_the_layout_get_the_dense_mask(monkeypatch):
    # A decoder whose layers do not pass keywords on would attend over the whole row: the learner sees that
    # the layout went unused, runs the dense mask instead, and does so from then on for that decoder class.
    model = _model(8)
    batch, made = _batch(), _layouts(monkeypatch)
    forward = forward_pass.decoder_forward
    monkeypatch.setattr(forward_pass, "decoder_forward",
                        lambda *a, packed_segments=None, **k: forward(*a, **k))
    with forward_pass.record_passes() as passes:
        dropped = _logprobs_and_grads(model, batch, share=True)
    assert made[0].calls == [0] and [p.layout for p in passes] == ["packed", "packed"]
    assert forward_pass._segments_unused == {type(model.get_decoder())}
    plain = _logprobs_and_grads(model, batch, share=False)
    mask = batch.loss_mask.bool()
    assert torch.allclose(dropped[0][mask], plain[0][mask], atol=1e-5)
    with forward_pass.record_passes() as passes:
        _logprobs_and_grads(model, batch, share=True)
    assert len(made) == 1 and [p.layout for p in passes] == ["packed"]  # no second try


def test_segments_only_where_cheaper(monkeypatch):
    # Short answers: the dense mask's few pairs beat the segments' overhead; long ones: segments.
    model = _model(9)
    chosen = []
    monkeypatch.setattr(forward_pass, "_packed", lambda *a: chosen.append(a[-1]))
    short = collate([_traj(list(range(5, 45)), [20] * n, i // 8) for i, n in enumerate([6] * 15 + [33])], 2)
    long = collate([_traj(list(range(5, 45)), [20] * 300, i // 8) for i in range(16)], 2)
    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 10**9)  # the packed row either way
    forward_pass.response_hidden(model, short, False)
    forward_pass.response_hidden(model, long, False)
    assert chosen == [False, True]


def test_segments_on_qwen2_with_biases_and_on_lora(monkeypatch):
    # Another family (q/k/v biases, untied head) and a LoRA-wrapped policy reach the attention the same way.
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        attn_implementation="sdpa"))
    assert use_float32_attention(qwen)
    lora = get_peft_model(_model(11), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    batch, made = _batch(), _layouts(monkeypatch)
    mask = batch.loss_mask.bool()
    for model in (qwen, lora):
        segmented = _logprobs_and_grads(model, batch, share=True)
        assert made[-1].calls == [2]  # both layers read the layout
        plain = _logprobs_and_grads(model, batch, share=False)
        assert torch.allclose(segmented[0][mask], plain[0][mask], atol=1e-5)
        assert torch.allclose(segmented[1], plain[1], atol=1e-5)
