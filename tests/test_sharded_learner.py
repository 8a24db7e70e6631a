"""The sharded learner (FSDP2 over gloo ranks) takes the update one process takes on the same batch: loss,
gradient norm and weights after the step agree to float32 rounding, for token-mean and sequence-mean
aggregation, with and without LoRA."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from polyrl.config import AlgorithmConfig, ConfigError, LearnerConfig, LoraConfig, OptimConfig
from polyrl.config_check import load_config
from polyrl.learner import logprobs
from polyrl.learner.learner import Learner
from polyrl.models.loading import load_model
from polyrl.parallel.fsdp import gather_into
from polyrl.parallel.group import (
    RankFailedError,
    backend_for,
    balanced_shards,
    contiguous_shards,
    current,
)
from polyrl.parallel.launch import check_devices, fork_server
from polyrl.run.loop import train
from polyrl.types import Trajectory
from tests.conftest import SMOKE
from tests.dist_helpers import run_ranks

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

MIS = {"off_policy": {"correction": "mis", "kwargs": {"cap": 1.5, "drop": True}}}
CASES = [(agg, lora) for agg in ("token-mean", "seq-mean-token-mean") for lora in (False, True)]


def _trajectories(n_groups: int = 3, group: int = 4, seed: int = 0, tasks: int = 1) -> list[Trajectory]:
    """Groups with prompts and responses of different lengths (so ranks get unequal tokens), varied rewards."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, 60) for _ in range(3 + 2 * g)]
        rewards = [float(rng.random() < 0.5) for _ in range(group)]
        mean = sum(rewards) / group
        for i in range(group):
            resp = [rng.randrange(3, 60) for _ in range(2 + rng.randrange(6))]
            n = len(prompt) + len(resp)
            out.append(Trajectory(
                task=f"t{g % tasks}", item_id=g, group_id=g, input_ids=prompt + resp,
                loss_mask=[0] * len(prompt) + [1] * len(resp), logprobs=[-1.0] * n, versions=[0] * n,
                reward=rewards[i], advantage=rewards[i] - mean + 0.1 * i,
            ))
    return out


def _update(agg: str, lora: bool, n_groups: int = 3, group: int = 4,
            sharding: LearnerConfig | None = None, tasks: int = 1, **algo_kw) -> tuple[dict, dict[str, torch.Tensor]]:
    """One update of a tiny float32 policy; returns the metrics and the whole weights after it."""
    torch.manual_seed(0)  # LoRA's initial adapters come from the global generator
    model = load_model("tiny-random", LoraConfig(r=4, alpha=8) if lora else None, seed=3)
    with torch.no_grad():  # adapters that already differ from the base (B starts at 0: AdamW's first step
        for name, p in model.named_parameters():  # would be lr * sign(grad) on weights of size lr)
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    full = copy.deepcopy(model)
    algo = AlgorithmConfig(loss={"agg": agg, "clip_high": 0.28}, regularisers={"kl_coef": 0.05}, **algo_kw)
    learner = Learner(model, algo, OptimConfig(lr=1e-3, micro_batch_size=3, grad_clip=0.05), 1.0, False, pad_id=2,
                      sharding=sharding, ranks=current())  # the joined group's ranks (one process: rank 0 of 1)
    metrics = learner.update(_trajectories(n_groups, group, tasks=tasks))
    gather_into(model, full)
    return metrics, {k: v.detach().clone() for k, v in full.state_dict().items()}


def _on_rank(path: str) -> None:
    results = {case: _update(*case) for case in CASES}
    results["one row"] = _update("token-mean", False, n_groups=1, group=1)
    results["checkpointed"] = _update("token-mean", False, sharding=LearnerConfig(activation_checkpointing=True))
    results["mis"] = _update("token-mean", False, **MIS)
    results["pcgrad"] = _update("seq-mean-token-mean", True, n_groups=4, tasks=2, gradients={"surgery": "pcgrad"})
    if current().is_main:
        torch.save(results, path)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("ranks") / "results.pt")
    run_ranks(2, _on_rank, path)
    return torch.load(path)


@pytest.mark.parametrize(("agg", "lora"), CASES)
def test_two_ranks_take_the_one_process_update(two_ranks, agg, lora):
    one_metrics, one_weights = _update(agg, lora)
    two_metrics, two_weights = two_ranks[(agg, lora)]
    for key in ("loss", "loss/pg", "kl", "grad_norm"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    assert one_metrics["grad_norm"] > 0.05  # clipped: the clip factor depends on the whole norm
    # Per tensor, the difference's norm against the weights' (AdamW's first step is close to lr * sign(grad),
    # so a gradient entry near 0 whose float32 sum differs in order may move by up to lr: norms, not entries).
    moved = 0
    for name, w in one_weights.items():
        rel = float((two_weights[name] - w).norm() / w.norm().clamp(min=1e-12))
        assert rel <= 1e-5, (name, rel)
        moved += "lora_" in name or not lora
    assert moved > 0


def test_activation_checkpointing_recomputes_the_same_update(two_ranks):
    one_metrics, one_weights = _update("token-mean", False)
    two_metrics, two_weights = two_ranks["checkpointed"]
    assert two_metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-5)
    for name, w in one_weights.items():
        assert float((two_weights[name] - w).norm() / w.norm()) <= 1e-5, name


def test_activation_checkpointing_in_one_process_keeps_less_for_backward_and_gives_the_same_update(monkeypatch):
    # the output head checkpointed too, so what is kept is the layers' (the float32 head would keep its softmax)
    monkeypatch.setattr(logprobs, "KEPT_SOFTMAX_BYTES", 0)
    saved = []

    def keep(t):  # every tensor autograd keeps for the backward pass outside a checkpointed layer
        saved.append(t.numel() * t.element_size())
        return t

    def kept_bytes(sharding):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = _update("token-mean", False, sharding=sharding)
        return sum(saved), out

    plain_bytes, (plain_metrics, plain_weights) = kept_bytes(None)
    ckpt_bytes, (ckpt_metrics, ckpt_weights) = kept_bytes(LearnerConfig(activation_checkpointing=True))
    assert ckpt_bytes < 0.5 * plain_bytes  # the layers' activations are recomputed, not kept
    assert ckpt_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)
    for name, w in plain_weights.items():
        assert float((ckpt_weights[name] - w).norm() / w.norm()) <= 1e-5, name


def test_a_rank_without_rows_joins_the_passes_and_adds_nothing(two_ranks):
    """One trajectory over two ranks: rank 1 runs placeholder passes (the gathers are collectives)."""
    one_metrics, one_weights = _update("token-mean", False, n_groups=1, group=1)
    two_metrics, two_weights = two_ranks["one row"]
    assert two_metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-5)
    assert two_metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-5)
    for name, w in one_weights.items():
        assert float((two_weights[name] - w).norm() / w.norm()) <= 1e-5, name


def test_mismatch_metrics_and_sequence_correction_are_global(two_ranks):
    """The mismatch/ metrics are means over the whole batch's tokens, and MIS's sequence weights give the
    one-process loss and gradient norm, whichever rank a sequence lands on."""
    one_metrics, _ = _update("token-mean", False, **MIS)
    two_metrics, _ = two_ranks["mis"]
    keys = [k for k in one_metrics if k.startswith("mismatch/")]
    assert len(keys) == 4 and one_metrics["mismatch/beyond_band_frac"] > 0
    for key in [*keys, "loss", "grad_norm", "off_policy/masked_frac"]:
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    # The weights are not compared here: this update moves some weights by about one learning rate in norm,
    # from gradient entries near zero, and AdamW's first step (each entry divided by its own size) turns the two
    # layouts' rounding there into changes as large as the update (seen on an AVX2 CPU). The loss and the
    # gradient's norm above, equal to 1e-5, are what per-rank sequence weights would change.


def test_task_gradients_and_pcgrad_are_global(two_ranks):
    """Per-task gradient norms and cosines are over the whole gradient (shards' dot products summed over the
    ranks), and PCGrad's projection gives the one-process update."""
    one_metrics, one_weights = _update("seq-mean-token-mean", True, n_groups=4, tasks=2,
                                       gradients={"surgery": "pcgrad"})
    two_metrics, two_weights = two_ranks["pcgrad"]
    keys = [k for k in one_metrics if k.startswith("task_grad/")]
    assert len(keys) == 3
    for key in [*keys, "loss", "grad_norm"]:
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-4, abs=1e-6), key
    for name, w in one_weights.items():
        assert float((two_weights[name] - w).norm() / w.norm().clamp(min=1e-12)) <= 1e-5, name


def test_nccl_keeps_gloo_beside_it_for_host_tensors():
    assert backend_for("auto", torch.device("cuda")) == "cpu:gloo,cuda:nccl"
    assert backend_for("nccl", torch.device("cuda")) == "cpu:gloo,cuda:nccl"
    assert backend_for("auto", torch.device("cpu")) == "gloo"


def test_shards_split_by_cost_deterministically():
    shards = balanced_shards([10, 1, 7, 3, 3], 2)
    assert sorted(i for s in shards for i in s) == [0, 1, 2, 3, 4]
    loads = [sum([10, 1, 7, 3, 3][i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= 2
    assert balanced_shards([1], 3) == [[0], [], []]
    assert contiguous_shards(5, 2) == [(0, 3), (3, 5)]
    assert contiguous_shards(1, 2) == [(0, 1), (1, 1)]


def test_more_ranks_than_gpus_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RankFailedError, match="learner.world_size: 2 ranks but this machine has 1 GPU"):
        check_devices(2, torch.device("cuda"))


@pytest.mark.parametrize(("override", "key"), [
    (["runtime.kind=async"], "learner.world_size"),
    (["runtime.kind=ray", "runtime.num_workers=2"], "runtime.num_workers"),
    (["stages=[{name: a, kind: rl, steps: 1}]"], "learner.world_size: a pipeline"),
])
def test_runtimes_that_do_not_combine_with_ranks_are_config_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(SMOKE, ["learner.world_size=2", *override])


def test_a_one_process_checkpoint_is_not_resumed_by_ranks(tmp_path):
    """Several ranks cannot load a one-process checkpoint's optimizer: a one-line error says what to do."""
    cfg = load_config(SMOKE, ["eval.before=false", "eval.after=false", "logging.report=false", "train.steps=1"])
    train(cfg, tmp_path, log=lambda *_: None)
    ranks_cfg = load_config(SMOKE, ["eval.before=false", "eval.after=false", "logging.report=false",
                                    "train.steps=2", "learner.world_size=2"])
    with pytest.raises(RankFailedError, match="saved by one process; resume it with learner.world_size: 1"):
        train(ranks_cfg, tmp_path, resume=True, log=lambda *_: None)


def test_activation_checkpointing_without_packing_gives_the_same_update(monkeypatch):
    # Without packing the learner runs prompts once and responses on their KV cache, which a checkpointed layer
    # would drop (transformers turns caching off under checkpointing); the rows must then run without a cache.
    from polyrl.learner import forward_pass

    monkeypatch.setattr(forward_pass, "PACKED_ATTENTION", 0)
    plain_metrics, plain_weights = _update("token-mean", False)
    ckpt_metrics, ckpt_weights = _update("token-mean", False, sharding=LearnerConfig(activation_checkpointing=True))
    assert ckpt_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)
    for name, w in plain_weights.items():
        assert float((ckpt_weights[name] - w).norm() / w.norm()) <= 1e-5, name


def _write_environ(path: str) -> None:
    if current().is_main:
        with open(path, "w") as f:
            f.write(os.environ.get("POLYRL_TEST_LAUNCH", "unset"))


def test_ranks_see_the_launchers_environment_of_each_launch(tmp_path, monkeypatch):
    """Ranks fork from a fork server that keeps running between launches: each launch's ranks must still see
    the launcher's environment as it is at that launch, as spawned processes would."""
    for value in ("first", "second"):
        monkeypatch.setenv("POLYRL_TEST_LAUNCH", value)
        run_ranks(2, _write_environ, str(tmp_path / value))
        assert (tmp_path / value).read_text() == value
    monkeypatch.delenv("POLYRL_TEST_LAUNCH")
    run_ranks(2, _write_environ, str(tmp_path / "gone"))
    assert (tmp_path / "gone").read_text() == "unset"


def test_the_fork_server_imports_each_launchs_modules_from_this_processs_path(tmp_path, monkeypatch):
    """A module found through a folder added at run time (as pytest adds its test folders) is imported by the
    fork server, not by each child; a later launch's module too, by a server that replaced the first."""
    import multiprocessing

    for name in ("forked_a", "forked_b"):
        (tmp_path / f"{name}.py").write_text(
            "import os\nIMPORTED_BY = os.getpid()\n\n"
            "def report(path):\n    open(path, 'w').write(str(IMPORTED_BY != os.getpid()))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not multiprocessing.active_children()  # the server is only replaced while none of its children lives
    for name in ("forked_a", "forked_b", "forked_a"):
        module = __import__(name)
        child = fork_server(name).Process(target=module.report, args=(str(tmp_path / name),))
        child.start()
        child.join()
        assert (tmp_path / name).read_text() == "True", name  # imported before the child was forked
