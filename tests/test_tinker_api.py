"""The Tinker API server driven by the official ``tinker`` client on the tiny random model: every implemented
call, with losses, gradients and Adam updates checked against plain torch on an identically built model."""

from __future__ import annotations

import math

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from polyrl.models.loading import tiny_random_model  # noqa: E402
from polyrl.tinker_api.client import create_full_training_client  # noqa: E402
from polyrl.tinker_api.serve import build_server  # noqa: E402

MODEL = "tiny-random"
# Each test drives a server over HTTP through an SDK session (about a second to start them, and the tests near it).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    server = build_server(MODEL, bf16=False, checkpoint_dir=tmp_path_factory.mktemp("tinker")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service_client(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
    yield client
    client.close("success").result()


def policy_of(server, training_client):
    return server.service.models[training_client.model_id].policy


# --- hand-checked numbers -------------------------------------------------------------------------------------

# The third shares the first's prompt, as a group's samples do: the server runs that prompt once.
SEQS = [[1, 17, 905, 3102, 44, 9, 2], [1, 260, 31, 8, 7711], [1, 17, 905, 3102, 600, 2]]


def datum(seq: list[int], **inputs: list[float]) -> types.Datum:
    n = len(seq) - 1
    fields = {"target_tokens": torch.tensor(seq[1:])}
    fields.update({k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()})
    assert all(len(v) == n for k, v in inputs.items())
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=fields)


def reference_logprobs(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[i+1] | seq[:i+1]) from the transformers forward, one sequence at a time (no padding)."""
    logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Within float32 rounding of the tensor's scale: the server sums in another order (shared prompts,
    packed rows) than the one-sequence-at-a-time reference."""
    error = float((actual - expected).abs().max())
    assert error <= 2e-5 * float(expected.abs().max()) + 1e-8, f"{name}: max error {error:.3g}"


def weights_of(n: int) -> list[float]:
    return [0.0] * 2 + [1.0] * (n - 2)


# Sampling log-probs and advantages for the RL losses; the offsets put some ratios outside PPO's [0.8, 1.2].
def rl_inputs(ref_logprobs: list[torch.Tensor]) -> list[dict[str, list[float]]]:
    out = []
    for i, lp in enumerate(ref_logprobs):
        offsets = torch.tensor([0.0, 0.5, -0.4, 0.1, -0.05, 0.3][: len(lp)])
        adv = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -0.5][: len(lp)]) * (1 if i == 0 else -1)
        out.append({"logprobs": (lp.detach() + offsets).tolist(), "advantages": adv.tolist()})
    return out


def expected_loss(name: str, lp: torch.Tensor, inputs: dict[str, list[float]]) -> torch.Tensor:
    if name == "cross_entropy":
        return -(lp * torch.tensor(inputs["weights"])).sum()
    ratio = torch.exp(lp - torch.tensor(inputs["logprobs"]))
    adv = torch.tensor(inputs["advantages"])
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    assert name == "ppo"
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).sum()


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_forward_backward_loss_and_gradient_match_plain_torch(server, service_client, loss_fn):
    training = create_full_training_client(service_client, MODEL)
    ref = tiny_random_model(0)
    ref_lps = [reference_logprobs(ref, s) for s in SEQS]
    ce = loss_fn == "cross_entropy"
    inputs = [{"weights": weights_of(len(s) - 1)} for s in SEQS] if ce else rl_inputs(ref_lps)
    if loss_fn == "ppo":  # the batch has tokens on both sides of the clip range, so clipping is exercised
        pairs = zip(ref_lps, inputs, strict=True)
        ratios = torch.cat([torch.exp(lp.detach() - torch.tensor(i["logprobs"])) for lp, i in pairs])
        assert (ratios > 1.2).any() and (ratios < 0.8).any()

    result = training.forward_backward([datum(s, **i) for s, i in zip(SEQS, inputs, strict=True)], loss_fn).result()

    expected = sum(expected_loss(loss_fn, lp, i) for lp, i in zip(ref_lps, inputs, strict=True))
    assert result.metrics["loss:sum"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
    for out, lp in zip(result.loss_fn_outputs, ref_lps, strict=True):
        torch.testing.assert_close(out["logprobs"].to_torch(), lp.detach(), rtol=1e-5, atol=1e-5)
    expected.backward()
    served = dict(policy_of(server, training).named_parameters())
    for name, p in ref.named_parameters():
        assert served[name].grad is not None, name
        assert_grad_close(served[name].grad, p.grad, name)


def test_gradients_accumulate_and_optim_step_is_adamw(server, service_client):
    training = create_full_training_client(service_client, MODEL)
    ref = tiny_random_model(0)
    batch = [datum(s, weights=weights_of(len(s) - 1)) for s in SEQS]
    # Two forward_backward calls before a step add their gradients, as Tinker's do.
    training.forward_backward(batch[:1], "cross_entropy").result()
    training.forward_backward(batch[1:], "cross_entropy").result()
    loss = sum(-(reference_logprobs(ref, s) * torch.tensor(weights_of(len(s) - 1))).sum() for s in SEQS)
    loss.backward()
    served = dict(policy_of(server, training).named_parameters())
    for name, p in ref.named_parameters():
        assert_grad_close(served[name].grad, p.grad, name)
        # Adam divides by |grad|: where a gradient is near eps, float rounding moves the step. The step is
        # checked on the server's own gradients.
        p.grad = served[name].grad.clone()
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    response = training.optim_step(adam).result()

    torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1).step()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(served[name].detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert served[name].grad is None  # the step clears the gradients
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    assert response.metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-4)


def test_forward_backward_custom_runs_through_forward_and_cross_entropy(server, service_client):
    """The SDK computes a custom loss on the client (a forward, then a weighted cross_entropy): a loss equal to
    cross-entropy gives cross-entropy's gradients."""
    custom = create_full_training_client(service_client, MODEL)
    plain = create_full_training_client(service_client, MODEL)
    batch = [datum(s, weights=weights_of(len(s) - 1)) for s in SEQS]

    def nll(data, logprobs):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
        return loss, {"nll": float(loss)}

    result = custom.forward_backward_custom(batch, nll).result()
    expected = plain.forward_backward(batch, "cross_entropy").result()
    assert result.metrics["nll"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    ours, theirs = (dict(policy_of(server, c).named_parameters()) for c in (custom, plain))
    for name, p in theirs.items():
        assert_grad_close(ours[name].grad, p.grad, name)


def test_forward_computes_without_gradients(server, service_client):
    training = create_full_training_client(service_client, MODEL)
    result = training.forward([datum(SEQS[0], weights=weights_of(6))], "cross_entropy").result()
    ref_lp = reference_logprobs(tiny_random_model(0), SEQS[0])
    torch.testing.assert_close(result.loss_fn_outputs[0]["logprobs"].to_torch(), ref_lp.detach(), rtol=1e-5,
                               atol=1e-5)
    assert all(p.grad is None for p in policy_of(server, training).parameters())


# --- LoRA, sampling, checkpoints --------------------------------------------------------------------------------

GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


def test_lora_client_trains_adapters_and_samples_the_update(server, service_client):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
    info = training.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == MODEL
    tokenizer = training.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("two plus two")) == "two plus two"
    trainable = {n for n, p in policy_of(server, training).named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lm_head" in n for n in trainable)  # train_unembed defaults to true

    prompt, target = [1, 50, 60, 70], [900] * 6
    before = training.save_weights_and_get_sampling_client().result()
    assert before.sample(types.ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0].tokens != target
    seq = prompt + target
    example = datum(seq, weights=[0.0] * (len(prompt) - 1) + [1.0] * len(target))
    for _ in range(15):
        training.forward_backward([example], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2))
    after = training.save_weights_and_get_sampling_client().result()
    reply = after.sample(types.ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0]
    assert reply.tokens == target and reply.stop_reason == "length"
    # The earlier sampling client keeps sampling from the weights it was saved from.
    assert before.sample(types.ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0].tokens != target


def test_sampled_logprobs_and_prompt_logprobs_are_the_learners(server, service_client):
    training = create_full_training_client(service_client, MODEL)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SEQS[0])
    result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=5, temperature=1.0, seed=7),
                            include_prompt_logprobs=True).result()
    assert len(result.sequences) == 3 and len({s.sequence_id for s in result.sequences}) == 3
    ref = tiny_random_model(0)
    for s in result.sequences:
        full = SEQS[0] + s.tokens
        torch.testing.assert_close(torch.tensor(s.logprobs), reference_logprobs(ref, full)[-len(s.tokens):].detach(),
                                   rtol=1e-4, atol=1e-4)
    assert result.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), reference_logprobs(ref, SEQS[0]).detach(),
                               rtol=1e-4, atol=1e-4)
    scored = sampler.compute_logprobs(prompt).result()
    assert scored[0] is None and scored[1:] == pytest.approx(result.prompt_logprobs[1:], abs=1e-6)
    # The same seed samples the same tokens.
    again = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]


def test_stop_tokens_and_strings_end_samples(server, service_client, tok):
    sampler = service_client.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(SEQS[1])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
    tokens = free.sequences[0].tokens
    assert len(tokens) == 8 and free.sequences[0].stop_reason == "length"
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0,
                                                           stop=[tokens[2]])).result().sequences[0]
    assert by_id.tokens == tokens[: tokens.index(tokens[2]) + 1] and by_id.stop_reason == "stop"
    text = tok.decode(tokens[3:5])
    assert text.strip()
    by_text = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0,
                                                             stop=[text])).result().sequences[0]
    first = next(k for k in range(1, 9) if text in tok.decode(tokens[:k]))
    assert by_text.tokens == tokens[:first] and by_text.stop_reason == "stop"


def test_checkpoint_round_trip_restores_weights_and_optimizer(server, service_client):
    first = create_full_training_client(service_client, MODEL)
    batch = [datum(s, weights=weights_of(len(s) - 1)) for s in SEQS]
    adam = types.AdamParams(learning_rate=1e-2)
    first.forward_backward(batch, "cross_entropy")
    first.optim_step(adam).result()
    saved = first.save_state("round-trip").result()
    assert saved.path == f"tinker://{first.model_id}/weights/round-trip"
    second = service_client.create_training_client_from_state_with_optimizer(saved.path).result()
    assert second.get_info().is_lora is False
    # With the optimizer's moments restored, the next step moves both models alike.
    for client in (first, second):
        client.forward_backward(batch, "cross_entropy")
        client.optim_step(adam).result()
    a, b = (dict(policy_of(server, c).named_parameters()) for c in (first, second))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-local")
    run = rest.get_training_run_by_tinker_path(saved.path).result()
    assert run.training_run_id == first.model_id and run.last_checkpoint.tinker_path == saved.path
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    assert rest.list_checkpoints(first.model_id).result().checkpoints == []
    with pytest.raises(tinker.BadRequestError, match="no checkpoint at"):
        service_client.create_sampling_client(model_path=saved.path).result()


def test_sampler_weights_on_disk_sample_like_the_snapshot(server, service_client):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    training.forward_backward([datum(SEQS[0], weights=weights_of(6))], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("disk").result().path
    from_disk = service_client.create_sampling_client(model_path=path).result()
    snapshot = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SEQS[1])
    expect = snapshot.sample(prompt, 1, GREEDY).result().sequences[0].tokens
    assert from_disk.sample(prompt, 1, GREEDY).result().sequences[0].tokens == expect
    assert from_disk.get_base_model() == MODEL


# --- refusals -----------------------------------------------------------------------------------------------------

def test_unimplemented_calls_and_bad_requests_say_what(server, service_client):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=2).result()
    with pytest.raises(tinker.NotFoundError, match="save_weights_external"):
        training.save_weights_external("x").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'gspo' is not supported"):
        training.forward_backward([datum(SEQS[0], weights=weights_of(6))], "gspo").result()
    # stable_reinforce's data as the cookbook sends it (provenance naming a sampled sequence); the refusal says
    # which loss to pass instead.
    sampled = training.save_weights_and_get_sampling_client(record_stability_info=True).result().sample(
        types.ModelInput.from_ints(SEQS[0][:3]), 1, types.SamplingParams(max_tokens=4, stop=[])).result()
    seq = sampled.sequences[0]
    provenance = datum(SEQS[0][:3] + seq.tokens, logprobs=[0.0] * 2 + seq.logprobs,
                       advantages=[0.0] * 2 + [1.0] * 4).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=3),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=4)])
    with pytest.raises(tinker.RequestFailedError,
                       match="loss_fn 'stable_reinforce' is not supported: .*pass loss_fn='importance_sampling'"):
        training.forward_backward([provenance], "stable_reinforce").result()
    assert math.isfinite(training.forward([provenance], "importance_sampling").result().metrics["loss:sum"])
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\]: loss_fn 'ppo' needs loss_fn_inputs\['logprobs'\]"):
        training.forward_backward([datum(SEQS[0], advantages=[1.0] * 6)], "ppo").result()
    # A refused request takes its place in the model's sequence: the next one still runs.
    result = training.forward([datum(SEQS[0], weights=weights_of(6))], "cross_entropy").result()
    assert math.isfinite(result.metrics["loss:sum"])
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    sampler = service_client.create_sampling_client(base_model=MODEL).result()
    with pytest.raises(tinker.RequestFailedError, match="exceeds the model's context"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=5000)).result()


def test_the_head_runs_on_the_datums_positions_not_the_padding(monkeypatch):
    # Three datums of 3, 6 and 12 tokens whose weights start at 2: the pass with gradients lays them out padded
    # to the longest, but the output head sees only their own positions (1 + 4 + 10 = 15 rows, in one chunk),
    # and the log-probs equal a plain forward's.
    from polyrl.learner import logprobs
    from polyrl.tinker_api import passes
    from polyrl.tinker_api.wire import Datum

    model = tiny_random_model(seed=3)
    rows = []
    head = logprobs.chunked_logprobs
    monkeypatch.setattr(logprobs, "chunked_logprobs",
                        lambda m, hidden, *a, **k: rows.append(tuple(hidden.shape[:-1])) or head(m, hidden, *a, **k))
    data = []
    for n in (3, 6, 12):
        tokens = list(range(5, 5 + n + 1))
        weights = torch.tensor([0.0, 0.0] + [1.0] * (n - 2))
        data.append(Datum(tokens=tokens[:-1], inputs={"target_tokens": torch.tensor(tokens[1:]), "weights": weights}))
    got = passes.datum_logprobs(model, data, [2, 2, 2], bf16=False, pad_id=0, grad=True)
    assert rows == [(1, 15)]  # the pass with gradients (the prefix's gradient-free pass is passes' own call)
    for datum, lp in zip(data, got, strict=True):
        full = torch.log_softmax(model(torch.tensor([datum.tokens])).logits[0].float(), -1)
        want = full.gather(-1, datum.inputs["target_tokens"][:, None])[:, 0]
        torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
