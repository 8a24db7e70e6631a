"""LoRA: only adapters train, and the KL reference is the same weights with adapters disabled."""

import gc
from pathlib import Path

import pytest
import torch

from polyrl.config import AlgorithmConfig, LoraConfig, OptimConfig
from polyrl.learner.batch import collate
from polyrl.learner.learner import Learner
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import holds_bf16_weights, load_model
from polyrl.types import Trajectory


def _batch():
    prompt, resp = [5, 6, 7, 8], [20, 21, 22]
    t = Trajectory(task="t", item_id=0, group_id=0, input_ids=prompt + resp, loss_mask=[0] * 4 + [1] * 3,
                   logprobs=[0.0] * 7, versions=[0] * 7, advantage=1.0)
    return [t, Trajectory(**{**t.__dict__, "advantage": -1.0, "input_ids": prompt + [23, 24, 25]})]


@pytest.mark.slow
def test_lora_reference_is_base_model_without_a_copy():
    torch.manual_seed(0)
    base = load_model("tiny-random", None, seed=1)
    policy = load_model("tiny-random", LoraConfig(r=4, alpha=8), seed=1)
    algo = AlgorithmConfig(regularisers={"kl_coef": 0.1})
    learner = Learner(policy, algo, OptimConfig(lr=1e-2), 1.0, False, pad_id=2)
    assert learner.ref_model is None  # no second copy of the weights
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    batch = collate(_batch(), pad_id=2)
    expected = token_logprobs(base, batch, 1.0, False)[0]
    for _ in range(3):
        metrics = learner.update(_batch())
    # After updates the policy moved away from the base, the reference did not.
    assert metrics["kl"] > 0
    assert torch.allclose(learner._reference_logprobs(batch), expected, atol=1e-5)
    assert not torch.allclose(token_logprobs(policy, batch, 1.0, False)[0], expected, atol=1e-4)


@pytest.mark.slow
def test_bf16_frozen_base_gives_the_same_updates_as_float32_under_autocast():
    """Autocast casts float32 weights to bf16 for each matmul; storing the frozen base in bf16 must not change
    the numbers, only the bytes."""
    runs = []
    for bf16_base in (False, True):
        torch.manual_seed(0)
        policy = load_model("tiny-random", LoraConfig(r=4, alpha=8, bf16_base=bf16_base), seed=1, bf16=True)
        assert holds_bf16_weights(policy) == bf16_base
        algo = AlgorithmConfig(regularisers={"kl_coef": 0.1})
        learner = Learner(policy, algo, OptimConfig(lr=1e-2), 1.0, True, pad_id=2)
        metrics = [learner.update(_batch()) for _ in range(3)]
        lora = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        runs.append((metrics, lora))
    (m32, w32), (m16, w16) = runs
    for a, b in zip(m32, m16, strict=True):
        for key in ("loss", "kl", "entropy"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert w32.keys() == w16.keys()
    assert all(torch.allclose(w32[n], w16[n], atol=1e-6) for n in w32)


def test_bf16_base_is_shared_by_the_engine_copy():
    from polyrl.engines.hf import bf16_copy

    policy = load_model("tiny-random", LoraConfig(r=4, alpha=8), seed=1, bf16=True)
    copy = bf16_copy(policy)
    base = {n: p.data_ptr() for n, p in policy.named_parameters() if "base_layer" in n}
    shared = {n: p.data_ptr() for n, p in copy.named_parameters() if n in base}
    assert base and shared == base  # no second copy of the frozen base


@pytest.mark.slow
def test_bf16_base_releases_the_checkpoints_file_mapping(tmp_path):
    """transformers memory-maps a safetensors checkpoint: a frozen weight left in the mapping keeps the whole
    file's pages resident beside the bf16 copies, so nothing of the file may stay mapped."""
    from polyrl.models.loading import tiny_random_model

    tiny_random_model(seed=1).save_pretrained(tmp_path / "ckpt")
    weights = str(tmp_path / "ckpt" / "model.safetensors")
    mapped = lambda: weights in Path("/proc/self/maps").read_text()  # noqa: E731
    full = load_model(str(tmp_path / "ckpt"), None, seed=1)
    assert mapped()  # the full fine-tune writes its weights (copy-on-write): the mapping is no waste there
    del full
    gc.collect()
    policy = load_model(str(tmp_path / "ckpt"), LoraConfig(r=4, alpha=8), seed=1, bf16=True)
    gc.collect()
    assert holds_bf16_weights(policy) and not mapped()
