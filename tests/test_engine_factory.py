"""Engine selection (``engine.kind``) and the learner-side recomputation of behaviour log-probs; no vLLM needed."""

import importlib.util

import pytest
import torch

from polyrl.config_check import load_config
from polyrl.engines import EngineUnavailableError, make_engine
from polyrl.engines.hf import HFEngine
from polyrl.engines.recompute import RecomputeLogprobs, policy_logprobs
from polyrl.learner.batch import collate
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.types import Trajectory

SMOKE = "configs/smoke.yaml"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", seed=3), load_tokenizer("tiny-random")


def test_default_engine_is_hf(tiny):
    model, tok = tiny
    engine = make_engine(load_config(SMOKE), model, tok)
    assert isinstance(engine, HFEngine)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_vllm_is_one_line_telling_how_to_install(tiny):
    model, tok = tiny
    config = load_config(SMOKE, ["engine.kind=vllm"])
    with pytest.raises(EngineUnavailableError) as info:
        make_engine(config, model, tok)
    message = str(info.value)
    assert "\n" not in message
    assert "engine.kind" in message and "pip install" in message and "polyrl[vllm]" in message


def test_unknown_engine_kind_names_the_key():
    with pytest.raises(ValueError, match="engine.kind"):
        load_config(SMOKE, ["engine.kind=sglang"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_are_the_learners(tiny, temperature):
    """With recompute, the behaviour log-probs the loop stores equal what the learner computes for those tokens
    (through its own collate / prefix-sharing path), not the bf16 sampling copy's."""
    model, tok = tiny
    config = load_config(SMOKE, ["engine.recompute_logprobs=true", "engine.bf16_weights=true", "model.bf16=false"])
    engine = make_engine(config, model, tok)
    assert isinstance(engine, RecomputeLogprobs) and isinstance(engine.engine, HFEngine)
    assert engine.engine.head_weight is not None  # sampling really runs on the bf16 copy
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10]]
    groups = engine.generate(prompts, n=3, max_new_tokens=6, temperature=temperature, seed=1)
    raw = engine.engine.generate(prompts, n=3, max_new_tokens=6, temperature=temperature, seed=1)
    trajectories = []
    for g, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        for c in group:
            ids = prompt + c.token_ids
            trajectories.append(Trajectory(
                task="t", item_id=g, group_id=g, input_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(c.token_ids),
                logprobs=[0.0] * len(prompt) + c.logprobs, versions=[0] * len(ids),
            ))
    batch = collate(trajectories, pad_id=engine.pad_id)
    learner_logp = token_logprobs(model, batch, temperature, bf16=False)[0]
    mask = batch.loss_mask.bool()
    assert torch.allclose(batch.behaviour_logp[mask], learner_logp[mask], atol=1e-4)
    # Same tokens as the wrapped engine sampled (recomputing never changes what was sampled) ...
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in raw]
    # ... but the bf16 copy's own log-probs were different numbers.
    raw_lp = torch.tensor([lp for g in raw for c in g for lp in c.logprobs])
    assert not torch.allclose(raw_lp, batch.behaviour_logp[mask], atol=1e-6)


def test_policy_logprobs_handles_empty_and_uneven_completions(tiny):
    model, _ = tiny
    out = policy_logprobs(model, [1, 5, 6], [[7, 8, 9], [], [10]], 1.0, bf16=False, pad_id=2)
    assert [len(x) for x in out] == [3, 0, 1]
    alone = policy_logprobs(model, [1, 5, 6], [[10]], 1.0, bf16=False, pad_id=2)
    assert out[2] == pytest.approx(alone[0], abs=1e-5)  # padding of longer rows does not leak in
