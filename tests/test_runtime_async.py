"""The async runtime: eta = 0 reproduces the local run exactly; eta > 0 overlaps and respects the bound;
partial rollouts continue a response under new weights with per-token versions and log-probs."""

import json

import pytest
import torch

from polyrl.config import RolloutConfig
from polyrl.config_check import load_config
from polyrl.run.loop import train
from polyrl.train.step import build_run
from tests.conftest import SMOKE

# An entropy bonus makes every update move the weights even though the tiny random model never scores,
# so a runtime that used the wrong weights for a step would produce different numbers.
BASE = [
    "eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false",
    "train.checkpoint_every=0", "train.steps=3", "algorithm.regularisers.entropy_coef=0.05", "optim.lr=0.01",
    "engine.bf16_weights=false",
]
TIMING = ("time", "per_s")


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _comparable(record):
    return {k: v for k, v in record.items() if not any(t in k for t in TIMING) and not k.startswith("staleness")}


@pytest.mark.slow
def test_async_eta0_reproduces_the_local_run(tmp_path):
    local = load_config(SMOKE, BASE)
    asynchronous = load_config(SMOKE, [*BASE, "runtime.kind=async", "runtime.eta=0"])
    train(local, tmp_path / "local", log=lambda *_: None)
    train(asynchronous, tmp_path / "async", log=lambda *_: None)
    a, b = _metrics(tmp_path / "local"), _metrics(tmp_path / "async")
    assert len(a) == len(b) == 3
    assert a[-1]["grad_norm"] > 0  # the weights did move, so equal metrics mean equal weights per step
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    assert all(r["staleness/max"] == 0 for r in b)


@pytest.mark.slow
def test_async_eta1_partial_rollouts_respect_the_bound(tmp_path):
    cfg = load_config(SMOKE, [*BASE, "train.steps=4", "runtime.kind=async", "runtime.eta=1",
                              "runtime.partial_rollouts=true", "runtime.chunk_tokens=2",
                              "algorithm.off_policy=tis"])
    train(cfg, tmp_path / "run", log=lambda *_: None)
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0 <= r["staleness/max"] <= 1 for r in records)
    assert all("off_policy/is_weight" in r for r in records)
    # Trained tokens' versions are within the bound of the learner version at their step.
    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines():
        row = json.loads(line)
        versions = [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m]
        assert row["step"] - 1 - min(versions) <= 1


@pytest.mark.slow
def test_a_partial_rollout_spans_versions_with_each_tokens_own_logprob(tmp_path):
    from polyrl.engines.hf import HFEngine
    from polyrl.learner.batch import collate
    from polyrl.learner.logprobs import token_logprobs
    from polyrl.rollout.multi_turn import rollout
    from polyrl.runtime.partial import PartialEngine

    cfg = load_config(SMOKE, [*BASE, "model.bf16=false", "rollout.max_new_tokens=6"])
    run = build_run(cfg, tmp_path)
    engine = HFEngine(run.model, run.tokenizer, bf16=False)  # samples from the policy's own weights
    states = {0: {k: v.clone() for k, v in run.model.state_dict().items()}}
    calls = []

    def refresh() -> int:  # a new policy version arrives after every chunk
        calls.append(1)
        version = len(calls) - 1
        if version not in states:
            with torch.no_grad():
                for p in run.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            states[version] = {k: v.clone() for k, v in run.model.state_dict().items()}
            engine.sync()  # the new weights into the engine, as the async runtime's refresh does
        return version

    task = run.tasks["chain_sum"]
    trajectories = rollout(PartialEngine(engine, 2, refresh), [(task, 0, task.train_item(0))],
                           RolloutConfig(group_size=2, max_new_tokens=6), seed=3, version=0)
    spans = [sorted({v for v, m in zip(t.versions, t.loss_mask, strict=True) if m}) for t in trajectories]
    assert any(len(s) > 1 for s in spans), spans  # a continued response carries several versions
    for t in trajectories:
        s = t.prompt_len
        for version in sorted(set(t.versions[s:])):
            run.model.load_state_dict(states[version])
            batch = collate([t], engine.pad_id)
            logp, _ = token_logprobs(run.model, batch, 1.0, False, share_prefix=False)
            mine = torch.tensor([v == version for v in t.versions[s:]])
            stored = torch.tensor(t.logprobs[s:])
            assert torch.allclose(logp[0][mine], stored[mine], atol=1e-4), version


@pytest.mark.parametrize("override", ["runtime.num_workers=2", "runtime.partial_rollouts=true"])
def test_runtime_config_errors_name_the_key(override):
    from polyrl.config import ConfigError

    extra = ["runtime.kind=async"] if "num_workers" in override else []
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(SMOKE, [*extra, override])
