"""learner/forward_pass.py: responses in length buckets, and all responses packed into one row, give the log-probs
and gradients of one padded pass; the buckets are the cheapest split; the cheaper of the two ways is taken."""

import itertools
import random

import torch

from polyrl.learner import forward_pass
from polyrl.learner.batch import collate
from polyrl.learner.forward_pass import length_buckets
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import tiny_random_model
from polyrl.types import Trajectory


def _cost(lengths, buckets, overhead):
    return sum(len(b) * max(lengths[i] for i in b) + overhead for b in buckets)


def test_one_long_answer_gets_its_own_bucket():
    lengths = [6, 7, 6, 33, 8, 6, 7, 6]
    assert length_buckets(lengths, overhead=8) == [[3], [0, 1, 2, 4, 5, 6, 7]]
    assert length_buckets(lengths, overhead=200) == [list(range(8))]  # not worth a second pass
    assert length_buckets([5, 5, 5], overhead=0) == [[0, 1, 2]]  # equal lengths: nothing to save


def test_buckets_are_the_cheapest_split():
    # Against every way to split rows into groups (brute force over set partitions of up to 6 rows).
    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for k in range(len(part)):
                yield part[:k] + [[first, *part[k]]] + part[k + 1 :]
            yield [[first], *part]

    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 6))]
        overhead = rng.choice([0, 5, 16, 64])
        buckets = length_buckets(lengths, overhead)
        assert sorted(itertools.chain(*buckets)) == list(range(len(lengths)))
        best = min(_cost(lengths, p, overhead) for p in partitions(list(range(len(lengths)))))
        assert _cost(lengths, buckets, overhead) == best


def _traj(prompt, response, group):
    ids = prompt + response
    return Trajectory(task="t", item_id=group, group_id=group, input_ids=ids,
                      loss_mask=[0] * len(prompt) + [1] * len(response), logprobs=[0.0] * len(ids),
                      versions=[0] * len(ids))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bucketed_pass_matches_one_padded_pass(monkeypatch):
    # Groups sharing prompts, answers from 1 to 9 tokens: with a zero bucket cost every length is a bucket.
    p1, p2 = [5, 6, 7, 8, 9], [11, 12, 13]
    trajs = [_traj(p1, list(range(20, 29)), 0), _traj(p1, [23], 0), _traj(p1, [24, 25], 0),
             _traj(p2, [30, 31, 32, 33], 1), _traj(p2, [34, 35], 1), _traj(p2, [36, 37, 38, 39, 40, 41], 1)]
    batch = collate(trajs, pad_id=2)
    model = tiny_random_model(seed=3)
    calls = []
    forward = forward_pass.decoder_forward
    monkeypatch.setattr(forward_pass, "decoder_forward", lambda *a, **k: calls.append(a[1].shape) or forward(*a, **k))
    out = {}
    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 0)  # packing off: buckets only
    for overhead, share in ((0, True), (10**6, False)):
        monkeypatch.setattr(forward_pass, "BUCKET_OVERHEAD", overhead)
        model.zero_grad(set_to_none=True)
        calls.clear()
        logp, ent = token_logprobs(model, batch, temperature=0.7, bf16=False, share_prefix=share)
        (logp * batch.loss_mask * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum().backward()
        out[share] = (logp.detach(), ent, _grads(model), list(calls))
    # bucketed: the two prompts once, then rows of 9, 6, 4 and 2 tokens (8, 5, 3, 1 columns); the 1-token
    # answer needs no response pass. Plain: one pass over the padded batch.
    assert out[True][3] == [(2, 5), (1, 8), (1, 5), (1, 3), (2, 1)]
    assert out[False][3] == [(6, 14)]
    mask = batch.loss_mask.bool()
    assert torch.allclose(out[True][0][mask], out[False][0][mask], atol=1e-5)
    assert torch.allclose(out[True][1][mask], out[False][1][mask], atol=1e-5)
    assert torch.allclose(out[True][2], out[False][2], atol=1e-5)


def test_learner_head_skips_padding_and_matches():
    # Learner._forward runs the output head on response tokens only: the same log-probs as the padded head
    # at those tokens, zeros at padding.
    from polyrl.config import AlgorithmConfig, OptimConfig
    from polyrl.learner.learner import Learner

    trajs = [_traj([5, 6, 7], [20, 21, 22, 23, 24, 25], 0), _traj([5, 6, 7], [26], 0), _traj([8, 9], [27, 28], 1)]
    batch = collate(trajs, pad_id=2)
    model = tiny_random_model(seed=4)
    learner = Learner(model, AlgorithmConfig(regularisers={"track_kl": False}), OptimConfig(), 0.7, False, pad_id=2)
    logp, ent, _, _ = learner._forward(batch)
    ref_logp, ref_ent = token_logprobs(model, batch, temperature=0.7, bf16=False, share_prefix=False)
    used = batch.attention_mask[:, -batch.response_len :].bool()
    assert torch.allclose(logp[used], ref_logp[used], atol=1e-5)
    assert torch.allclose(ent[used], ref_ent[used], atol=1e-5)
    assert not logp[~used].any() and (~used).any()


def _mixed_batch():
    # Two groups with different prompts (one left-padded), answers of 1 to 9 tokens.
    p1, p2 = [5, 6, 7, 8, 9], [11, 12, 13]
    trajs = [_traj(p1, list(range(20, 29)), 0), _traj(p1, [23], 0), _traj(p1, [24, 25], 0),
             _traj(p2, [30, 31, 32, 33], 1), _traj(p2, [34, 35], 1), _traj(p2, [36, 37, 38, 39, 40, 41], 1)]
    return collate(trajs, pad_id=2)


def _logprobs_and_grads(model, batch, share):
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, batch, temperature=0.7, bf16=False, share_prefix=share)
    (logp * batch.loss_mask * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), ent, _grads(model)


def test_packed_row_matches_one_padded_pass(monkeypatch):
    batch = _mixed_batch()
    model = tiny_random_model(seed=5)
    calls = []
    forward = forward_pass.decoder_forward
    monkeypatch.setattr(forward_pass, "decoder_forward", lambda *a, **k: calls.append(a[1].shape) or forward(*a, **k))
    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 10**9)  # packing always wins
    packed = _logprobs_and_grads(model, batch, share=True)
    # One pass over both prompts (5 + 3 tokens) and every answer but its last token (8 + 0 + 1 + 3 + 1 + 5).
    assert calls == [(1, 26)]
    plain = _logprobs_and_grads(model, batch, share=False)
    mask = batch.loss_mask.bool()
    for a, b in zip(packed, plain, strict=True):
        assert torch.allclose(a[mask] if a.dim() == 2 else a, b[mask] if b.dim() == 2 else b, atol=1e-5)


def test_packed_row_matches_on_qwen2_with_biases(monkeypatch):
    # Another family (q/k/v biases, untied head), where the mask and positions reach the attention the same way.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    batch = _mixed_batch()
    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 10**9)
    packed = _logprobs_and_grads(model, batch, share=True)
    plain = _logprobs_and_grads(model, batch, share=False)
    mask = batch.loss_mask.bool()
    assert torch.allclose(packed[0][mask], plain[0][mask], atol=1e-5)
    assert torch.allclose(packed[2], plain[2], atol=1e-5)


def test_cheaper_way_is_taken(monkeypatch):
    # Short answers: one packed pass beats a prompt pass plus buckets; long answers make the packed row's
    # attention cost more than the buckets save; models with a sliding window or eager attention never pack.
    model = tiny_random_model(seed=6)
    calls = []
    monkeypatch.setattr(forward_pass, "_packed", lambda *a: calls.append("packed"))
    monkeypatch.setattr(forward_pass, "_bucketed", lambda *a: calls.append("buckets"))
    short = collate([_traj(list(range(5, 45)), [20] * n, i // 8) for i, n in enumerate([6] * 15 + [33])], 2)
    long = collate([_traj(list(range(5, 45)), [20] * 64, i // 8) for i in range(16)], 2)
    forward_pass.response_hidden(model, short, False)
    forward_pass.response_hidden(model, long, False)
    assert calls == ["packed", "buckets"]
    model.config.sliding_window, model.config.use_sliding_window = 4, True
    forward_pass.response_hidden(model, short, False)
    model.config.sliding_window = None
    model.config._attn_implementation = "eager"
    forward_pass.response_hidden(model, short, False)
    assert calls[2:] == ["buckets", "buckets"]
