"""End-to-end on the real bundled SmolLM2-135M-Instruct.

The GGUF is converted to a cached float32 checkpoint on first use; this test covers that path, the chat
template, greedy evaluation and one RL step with LoRA on the real weights.
"""

import json
import math

import pytest
from conftest import ROOT

from polyrl.config_check import load_config
from polyrl.run.loop import train

pytestmark = pytest.mark.slow


def test_real_model_evaluates_and_takes_an_rl_step(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        ["train.steps=1", "train.max_minutes=null", "tasks.0.eval_size=8", "eval.after=false",
         "model.lora={r: 8, alpha: 16}", "algorithm.regularisers.kl_coef=0.01", "logging.progress=false",
         "logging.tensorboard=false", "logging.report=false",
         # One round of 2 x 4 short samples is a whole RL step: longer replies, wider groups and extra sampling
         # rounds add only time. The evaluation keeps the quickstart's reply length, so its answers are whole.
         "algorithm.sampling.dynamic=false", "rollout.group_size=4", "rollout.max_new_tokens=16",
         "eval.max_new_tokens=64"],
    )
    summary = train(cfg, tmp_path / "run", log=lambda _: None)
    # The instruct model already solves some one-digit sums greedily (about a third at 200 items; 3 of these 8).
    assert 0.0 < summary["eval_before"]["chain_sum"] < 1.0
    (step,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(step["loss"]) and step["kl"] is not None and step["response_length/mean"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "adapter_model.safetensors").exists()


def test_the_conversions_memoised_name_maps_equal_gguf_own_and_are_put_back():
    import gguf

    from polyrl.models.loading import _memoised_gguf_name_maps

    original = gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with _memoised_gguf_name_maps():
        first, again = gguf.get_tensor_name_map(arch, 30), gguf.get_tensor_name_map(arch, 30)
        assert first is again  # built once
        assert first.mapping == original(arch, 30).mapping
    assert gguf.get_tensor_name_map is original
