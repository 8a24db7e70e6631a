"""End-to-end on the real bundled SmolLM2-135M-Instruct (about a minute on 2 cores).

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
        ["train.steps=1", "train.max_minutes=null", "tasks.0.eval_size=16", "eval.after=false",
         "model.lora={r: 8, alpha: 16}", "algorithm.regularisers.kl_coef=0.01", "logging.progress=false",
         "logging.tensorboard=false"],
    )
    summary = train(cfg, tmp_path / "run", log=lambda _: None)
    # The instruct model already solves some one-digit sums greedily (about a third at 200 items).
    assert 0.0 < summary["eval_before"]["chain_sum"] < 1.0
    (step,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(step["loss"]) and step["kl"] is not None and step["response_length/mean"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "adapter_model.safetensors").exists()
