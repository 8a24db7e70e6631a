"""examples/grpo_in_one_file.py on the tiny model: it trains, its learner reads the sampler's distribution, and its
held-out evaluation returns an accuracy."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys

import pytest
import torch

from polyrl.config import parse_config
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import make_task
from polyrl.envs.reasoning_gym import ReasoningGymTask
from polyrl.models.loading import load_model, load_tokenizer
from tests.conftest import ROOT

TINY = ["--model", "tiny-random", "--max-new-tokens", "8", "--eval-n", "4", "--prompts", "2", "--group", "4"]


@functools.cache
def load_example():
    spec = importlib.util.spec_from_file_location("grpo_in_one_file", ROOT / "examples" / "grpo_in_one_file.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_two_steps_change_the_weights_with_finite_losses(monkeypatch, one_thread):
    # The random model never answers chain_sum, so every group would tie at 0 and nothing would move: a reward
    # that differs between replies (the reply's length being even) gives the groups something to compare.
    monkeypatch.setattr(ReasoningGymTask, "score", lambda self, item, reply: float(len(reply) % 2 == 0))
    result = load_example().main([*TINY, "--steps", "2", "--lr", "1e-3"])

    assert [r["step"] for r in result["history"]] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in result["history"])
    assert any(r["grad_norm"] > 0 for r in result["history"]), "no step had a gradient"
    assert 0.0 <= result["eval_before"] <= 1.0 and 0.0 <= result["eval_after"] <= 1.0
    start = load_model("tiny-random", seed=0)  # the weights main() started from
    trained = dict(result["policy"].named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in start.named_parameters())


@pytest.mark.slow
def test_the_learner_log_probs_are_the_sampler_log_probs(one_thread):
    """Off by one position, the loss would train each token on the logits of its neighbour: the log-probs the
    script computes for the sampled tokens must be the ones the engine sampled them with (float32 both)."""
    example = load_example()
    policy, tokenizer = load_model("tiny-random"), load_tokenizer("tiny-random")
    task = make_task(parse_config(example.QUICKSTART).tasks[0], seed=0)
    engine = HFEngine(policy, tokenizer, bf16=False)
    items = [task.train_item(i) for i in range(2)]
    samples = example.sample_groups(engine, task, items, group=4, max_new_tokens=12, seed=1)
    with torch.no_grad():
        logp, mask = example.response_logprobs(policy, samples, engine.pad_id, bf16=False)

    assert mask.sum() == sum(len(s.response) for s in samples)
    for i, s in enumerate(samples):
        torch.testing.assert_close(logp[i, : len(s.response)], torch.tensor(s.logprobs), atol=1e-4, rtol=0)
    # The same comparison one position off fails, so the check above can tell the two apart.
    assert not torch.allclose(logp[0, 1 : len(samples[0].response)], torch.tensor(samples[0].logprobs[:-1]),
                              atol=1e-4)
