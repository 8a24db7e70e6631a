"""Fast paths of the learner give the same log-probs and gradients as the plain path."""

import pytest
import torch

from polyrl.learner.batch import collate
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import tiny_random_model
from polyrl.types import Trajectory


def _traj(prompt, response, group):
    ids = prompt + response
    return Trajectory(
        task="t",
        item_id=group,
        group_id=group,
        input_ids=ids,
        loss_mask=[0] * len(prompt) + [1] * len(response),
        logprobs=[0.0] * len(ids),
        versions=[0] * len(ids),
    )


def _batch():
    # Two groups with different prompt lengths; responses of different lengths inside each group.
    p1, p2 = [5, 6, 7, 8, 9], [11, 12, 13]
    trajs = [
        _traj(p1, [20, 21, 22], 0),
        _traj(p1, [23], 0),
        _traj(p1, [24, 25], 0),
        _traj(p2, [30, 31, 32, 33], 1),
        _traj(p2, [34, 35], 1),
    ]
    return collate(trajs, pad_id=2)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_shared_prefix_matches_plain_forward_and_backward():
    model = tiny_random_model(seed=3)
    batch = _batch()
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = token_logprobs(model, batch, temperature=0.7, bf16=False, share_prefix=share)
        (logp * batch.loss_mask).sum().backward()
        out[share] = (logp.detach(), ent, _grads(model))
    mask = batch.loss_mask.bool()
    assert torch.allclose(out[True][0][mask], out[False][0][mask], atol=1e-5)
    assert torch.allclose(out[True][1][mask], out[False][1][mask], atol=1e-5)
    assert torch.allclose(out[True][2], out[False][2], atol=1e-5)


def test_logprobs_match_a_plain_model_call():
    # Reference: the HF model's own logits over the unpadded sequence.
    model = tiny_random_model(seed=4)
    batch = _batch()
    logp, _ = token_logprobs(model, batch, temperature=1.0, bf16=False)
    ids = [5, 6, 7, 8, 9, 20, 21, 22]
    ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, 4:7], -1)
    expected = ref.gather(-1, torch.tensor([[20], [21], [22]])).squeeze(-1)
    assert torch.allclose(logp[0, :3], expected, atol=1e-5)


def test_lr_schedules_worked_by_hand():
    from polyrl.learner.optimizer import lr_factor

    # warmup 2 of 10 steps: 0.5, 1.0; then linear decay over the remaining 8: step 6 is 4/8 of the way.
    assert [lr_factor(s, 2, 10, "linear") for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(4, 0, 8, "cosine") == pytest.approx(0.5) and lr_factor(8, 0, 8, "cosine") == pytest.approx(0.0)
    assert lr_factor(7, 0, 10, "constant") == 1.0


def test_micro_batch_rows_drop_shared_padding():
    batch = _batch()  # responses of lengths 3, 1, 2, 4, 2; prompts of 5 and 3 tokens
    short = batch.rows(slice(1, 3))  # responses 1 and 2 long, both prompts 5 long
    assert short.targets.shape == (2, 2) and short.input_ids.shape == (2, 7)
    full = batch.rows(slice(0, 5))
    assert full.targets.shape == (5, 4)
    model = tiny_random_model(seed=5)
    a, _ = token_logprobs(model, batch, 1.0, False)
    b, _ = token_logprobs(model, short, 1.0, False)
    assert torch.allclose(a[1:3, :2][short.loss_mask.bool()], b[short.loss_mask.bool()], atol=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_chunked_head_matches_whole_logits(bf16):
    # The output head in checkpointed chunks of 3 positions (responses are 4 long) against the [B, R, V] logits:
    # log-probs, entropy and every parameter's gradient (body and head) agree to float32 rounding.
    from polyrl.learner.forward_pass import response_hidden
    from polyrl.learner.logprobs import chunked_logprobs, logprobs_from_logits
    from polyrl.models.forward import head_logits

    model = tiny_random_model(seed=5)
    batch = _batch()
    out = {}
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        hidden = response_hidden(model, batch, bf16)
        if chunked:
            logp, ent = chunked_logprobs(model, hidden, batch.targets, 0.7, entropy_grad=True, chunk=3)
        else:
            logp, ent = logprobs_from_logits(head_logits(model, hidden) / 0.7, batch, entropy_grad=True)
        ((logp + 0.1 * ent) * batch.loss_mask).sum().backward()
        out[chunked] = (logp.detach(), ent.detach(), _grads(model))
    assert out[True][0].shape == batch.targets.shape
    for a, b in zip(out[True], out[False], strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_bf16_backward_head_matches_the_float32_head():
    # Forward exact: log-probs and entropy equal the float32 head's. Backward in bf16 matmuls: every gradient
    # (body and the tied head) within bf16 rounding of the float32 backward, and the same direction.
    from polyrl.learner.forward_pass import response_hidden
    from polyrl.learner.logprobs import chunked_logprobs

    model = tiny_random_model(seed=5)
    batch = _batch()
    out = {}
    for bf16_backward in (False, True):
        model.zero_grad(set_to_none=True)
        hidden = response_hidden(model, batch, True)
        logp, ent = chunked_logprobs(model, hidden, batch.targets, 0.7, chunk=3, bf16_backward=bf16_backward)
        (logp * batch.loss_mask * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum().backward()
        out[bf16_backward] = (logp.detach(), ent.detach(), _grads(model))
    assert torch.allclose(out[True][0], out[False][0], atol=1e-6)
    assert torch.allclose(out[True][1], out[False][1], atol=1e-6)
    exact, fast = out[False][2], out[True][2]
    assert fast.norm() > 0 and not torch.equal(fast, exact)  # the bf16 path ran
    assert (fast - exact).norm() / exact.norm() < 2e-2, (fast - exact).norm() / exact.norm()
    assert torch.nn.functional.cosine_similarity(fast, exact, dim=0) > 0.999


def test_float32_head_keeps_its_softmax_and_matches_the_recomputed_head(monkeypatch):
    # Float32 training: the kept float32 softmax gives the checkpointed head's log-probs and gradients to float32
    # rounding, with no recompute of the head; past KEPT_SOFTMAX_BYTES the head is checkpointed again.
    from polyrl.learner import logprobs
    from polyrl.learner.forward_pass import response_hidden

    model = tiny_random_model(seed=5)
    batch = _batch()
    calls = []
    head = logprobs._head_logprobs
    monkeypatch.setattr(logprobs, "_head_logprobs", lambda *a: calls.append(1) or head(*a))
    out = {}
    for kept_bytes in (10**9, 0):
        monkeypatch.setattr(logprobs, "KEPT_SOFTMAX_BYTES", kept_bytes)
        model.zero_grad(set_to_none=True)
        calls.clear()
        hidden = response_hidden(model, batch, False)
        logp, ent = logprobs.chunked_logprobs(model, hidden, batch.targets, 0.7, chunk=3)
        (logp * batch.loss_mask * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum().backward()
        out[kept_bytes] = (logp.detach(), ent.detach(), _grads(model), len(calls))
    chunks = -(-batch.targets.shape[1] // 3)
    assert out[10**9][3] == 0 and out[0][3] == 2 * chunks  # checkpointed: each chunk's head forward twice
    for a, b in zip(out[10**9][:3], out[0][:3], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()


@pytest.mark.slow
def test_micro_batches_change_no_update():
    # Micro-batches are cut from the batch sorted by prompt length and group (so a group's shared prompt is
    # computed once): any micro-batch size gives the same loss and the same gradient as one batch.
    from polyrl.config import AlgorithmConfig, OptimConfig
    from polyrl.learner.learner import Learner

    p1, p2 = [5, 6, 7, 8, 9, 10, 11], [12, 13]
    trajs = [_traj(p1 if g % 2 else p2, [20 + i, 21, 22][: 1 + (i + g) % 3], g) for g in range(4) for i in range(3)]
    for i, t in enumerate(trajs):
        t.advantage = (-1.0) ** i * (1 + i % 3) / 3
    result = {}
    for micro in (1, 4, 12):
        model = tiny_random_model(seed=2)
        learner = Learner(model, AlgorithmConfig(regularisers={"track_kl": False}),
                          OptimConfig(lr=1e-3, micro_batch_size=micro), 1.0, False, pad_id=2)
        metrics = learner.update(list(reversed(trajs)))
        result[micro] = (metrics["loss"], _grads(model))  # the update leaves the step's gradient in .grad
    assert result[12][1].norm() > 0
    for micro in (1, 4):
        assert abs(result[micro][0] - result[12][0]) < 1e-5
        assert torch.allclose(result[micro][1], result[12][1], atol=1e-6, rtol=1e-4)
