"""Sharded checkpoints (polyrl/checkpoint/sharded.py, export.py): a tiny Llama sharded by FSDP2 over two gloo ranks
saves, resumes bit-exact at two ranks and exactly at one (no process group); a one-process save resumes at two;
the HF export loads and decodes like the unsharded model; a save killed before its rename leaves the previous
checkpoint the newest. One spawn of two ranks runs every multi-rank part; the tests read what it recorded."""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from polyrl.checkpoint import faults
from polyrl.checkpoint.export import export_hf
from polyrl.checkpoint.sharded import is_sharded, load_sharded, read_model_tensors, save_sharded
from polyrl.checkpoint.store import latest_checkpoint, remove_partial_saves, verify_checkpoint
from polyrl.models.loading import tiny_random_model
from polyrl.parallel.launch import free_port

WS1 = "ws1/checkpoints/step-1"
WS2 = "ws2/checkpoints/step-1"
LORA2 = "lora2/checkpoints/step-1"
EXTRA = {"step": 1, "sampler": {"cursor": 3}, "best": 0.5}


def _model(seed: int) -> torch.nn.Module:
    model = tiny_random_model(seed)
    model.config._name_or_path = "tiny-random"  # as load_model records it: the export finds the tokenizer by it
    return model


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # Fused AdamW steps DTensor shards on the CPU in torch 2.13, as the learner uses it.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, _adamw(model)


class _PolicyAndCritic(torch.nn.Module):
    """Like the learner's FSDP root (learner/policy_pass.PolicyPass): the policy under a name, and a critic."""

    def __init__(self) -> None:
        from polyrl.config import LoraConfig
        from polyrl.models.loading import load_model

        super().__init__()
        self.policy = load_model("tiny-random", lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                                 float32_attention=False)
        self.value_head = torch.nn.Linear(32, 1)

    def forward(self, input_ids, labels):
        out = self.policy(input_ids=input_ids, labels=labels, output_hidden_states=True)
        return out.loss + self.value_head(out.hidden_states[-1]).pow(2).mean()


def _lora_root(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same critic and adapter initialisation everywhere
    root = _PolicyAndCritic()
    if sharded:
        for layer in root.policy.get_decoder().layers:
            fully_shard(layer)
        fully_shard(root)
    return root, torch.optim.AdamW([p for p in root.parameters() if p.requires_grad], lr=1e-2, fused=True)


def _train_step(model, optimizer, rank: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(100 * seed + rank)  # each rank its own batch, as data parallelism has it
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    out = model(input_ids=ids, labels=ids)
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model, optimizer) -> dict:
    """Whole weights and optimizer moments by parameter name (gathered from the shards under a group)."""
    if dist.is_initialized():
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return {"model": {k: v.clone() for k, v in msd.items()}, "optim": osd["state"]}
    named = dict(model.named_parameters())
    return {"model": dict(model.state_dict()), "optim": {n: dict(optimizer.state[p]) for n, p in named.items()}}


def _mismatches(got: dict, want: dict) -> list[str]:
    bad = [k for k in want["model"] if k not in got["model"] or not torch.equal(got["model"][k], want["model"][k])]
    for name, moments in want["optim"].items():
        for key, value in moments.items():
            if not torch.equal(torch.as_tensor(got["optim"].get(name, {}).get(key, torch.nan)), value):
                bad.append(f"optim {name} {key}")
    return bad


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_mismatches(m1, o1, m2, o2) -> list[str]:
    """Each rank's own shards of weights and optimizer state, compared bit for bit."""
    bad = []
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters(), strict=True):
        if not torch.equal(_local(p1), _local(p2)):
            bad.append(name)
        s1, s2 = o1.state[p1], o2.state[p2]
        bad += [f"optim {name} {k}" for k in s1 if k not in s2 or not torch.equal(_local(s1[k]), _local(s2[k]))]
    return bad


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    base = Path(root)
    results: dict = {}

    model, opt = _sharded(seed=7)
    load_sharded(base / WS1, model, opt)
    results["ws1_to_ws2"] = _mismatches(_full_state(model, opt), torch.load(base / "ws1_full.pt"))

    model, opt = _sharded(seed=0)
    _train_step(model, opt, rank)
    save_sharded(base / WS2, model, opt, EXTRA)
    results["rand_after_save"] = torch.rand(4).tolist()
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, base / "ws2_full.pt")

    resumed, ropt = _sharded(seed=9)
    results["extra"] = load_sharded(base / WS2, resumed, ropt)
    results["rng_restored"] = torch.rand(4).tolist() == results["rand_after_save"]
    results["ws2_to_ws2"] = _shard_mismatches(model, opt, resumed, ropt)
    _train_step(model, opt, rank, seed=1)
    _train_step(resumed, ropt, rank, seed=1)
    results["next_step"] = _shard_mismatches(model, opt, resumed, ropt)
    lora, lopt = _lora_root(sharded=True)
    _train_step(lora, lopt, rank)
    save_sharded(base / LORA2, lora, lopt, {"step": 1})
    lora_full = _full_state(lora, lopt)
    if rank == 0:
        torch.save(lora_full, base / "lora2_full.pt")
    (base / f"results-{rank}.json").write_text(json.dumps(results))
    dist.barrier()

    # A crash between the manifest and the rename: rank 0 is SIGKILLed there (the kill-and-resume tests' points).
    if rank == 0:
        os.environ[faults.KILL_AT] = "ckpt_manifest:2"
        os.environ[faults.TRACE] = str(base / "trace.txt")
    save_sharded(base / "ws2/checkpoints/step-2", model, opt, {**EXTRA, "step": 2})
    (base / f"survived-{rank}").write_text("the save was meant to be killed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, the spawn's exception): a one-process save, then the two ranks' scenario."""
    root = tmp_path_factory.mktemp("sharded")
    model, opt = _model(3), None
    opt = _adamw(model)
    _train_step(model, opt, rank=0)
    save_sharded(root / WS1, model, opt, EXTRA)
    torch.save(_full_state(model, opt), root / "ws1_full.pt")
    try:
        mp.start_processes(_worker, args=(free_port(), str(root)), nprocs=2, start_method="forkserver")
        error = None
    except ProcessException as exc:
        error = exc
    return root, error


def _results(runs) -> list[dict]:
    root, error = runs
    missing = [r for r in range(2) if not (root / f"results-{r}.json").exists()]
    assert not missing, f"ranks {missing} failed before recording results: {error}"
    return [json.loads((root / f"results-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_one_process_save_resumes_at_two_ranks(runs):
    assert [r["ws1_to_ws2"] for r in _results(runs)] == [[], []]


@pytest.mark.slow
def test_two_rank_save_resumes_bit_exact_at_two(runs):
    for r in _results(runs):
        assert r["ws2_to_ws2"] == [] and r["next_step"] == []
        assert r["rng_restored"] and r["extra"] == EXTRA


@pytest.mark.slow
def test_two_rank_save_resumes_at_one_without_a_group(runs):
    root, _ = runs
    rank0 = _results(runs)[0]
    model = _model(11)
    opt = _adamw(model)
    assert load_sharded(root / WS2, model, opt) == EXTRA
    assert _mismatches(_full_state(model, opt), torch.load(root / "ws2_full.pt")) == []
    assert torch.rand(4).tolist() == rank0["rand_after_save"]  # rank 0's RNG carries over


@pytest.mark.slow
def test_export_loads_and_decodes_like_the_unsharded_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _ = runs
    _results(runs)
    out = export_hf(root / "ws2", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    exported = AutoModelForCausalLM.from_pretrained(out)
    full = torch.load(root / "ws2_full.pt")["model"]
    assert all(torch.equal(v, full[k]) for k, v in exported.state_dict().items())
    unsharded = _model(12)
    load_sharded(root / WS2, unsharded)
    prompt = torch.tensor([[1, 504, 33, 890, 12, 7]])
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 2}
    assert torch.equal(exported.generate(prompt, **kw), unsharded.generate(prompt, **kw))


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint(runs):
    root, error = runs
    _results(runs)
    assert error is not None  # rank 0 was killed; rank 1, waiting for it in a barrier, failed or was stopped
    if isinstance(error, ProcessExitedException) and error.error_index == 0:
        assert error.signal_name == "SIGKILL"
    assert (root / "trace.txt").read_text().splitlines()[-1] == "ckpt_manifest:2"
    assert not list(root.glob("survived-*"))
    run = root / "ws2"
    assert (run / "checkpoints/.step-2.tmp/manifest.json").exists()  # whole but not renamed: never seen
    assert latest_checkpoint(run).name == "step-1" and is_sharded(latest_checkpoint(run))
    assert [p.name for p in remove_partial_saves(run)] == [".step-2.tmp"]


@pytest.mark.slow
def test_a_corrupt_shard_fails_verification(runs, tmp_path):
    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "ws1", run)
    shard = next((run / "checkpoints/step-1/dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "checksum mismatch in dcp/" in verify_checkpoint(run / "checkpoints/step-1")
    assert latest_checkpoint(run) is None


@pytest.mark.slow
def test_lora_policy_under_a_wrapper_resumes_at_one_and_exports_merged(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _ = runs
    _results(runs)
    saved = read_model_tensors(root / LORA2)
    assert saved and all(".lora_" in k or k.startswith("value_head.") for k in saved)  # the base is not saved
    lora, lopt = _lora_root(sharded=False)
    assert load_sharded(root / LORA2, lora, lopt) == {"step": 1}
    full = torch.load(root / "lora2_full.pt")
    state = lora.state_dict()
    assert all(torch.equal(state[k], v) for k, v in full["model"].items())
    moments = {n: lopt.state[p] for n, p in lora.named_parameters() if p.requires_grad}
    assert all(torch.equal(moments[n][k], v) for n, m in full["optim"].items() for k, v in m.items())

    merged = export_hf(root / "lora2", tmp_path / "merged", merge_lora=True)  # the base named in the checkpoint
    ids = torch.tensor([[1, 504, 33, 890, 12, 7]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        torch.testing.assert_close(got, lora.policy(input_ids=ids).logits)


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapter_and_exports(tmp_path):
    from peft import PeftModel

    from polyrl.config import LoraConfig
    from polyrl.models.loading import load_model

    def lora_model():
        return load_model("tiny-random", lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                          float32_attention=False)

    model = lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _train_step(model, opt, rank=0)
    save_sharded(tmp_path / "run/checkpoints/step-4", model, opt, {"step": 4}, keep=1)
    ckpt = tmp_path / "run/checkpoints/step-4"
    assert verify_checkpoint(ckpt) is None
    saved = read_model_tensors(ckpt)
    assert saved and all(".lora_" in k for k in saved)  # the frozen base comes from the base model

    resumed = lora_model()
    ropt = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
    assert load_sharded(ckpt, resumed, ropt) == {"step": 4}
    want_sd, got_sd = model.state_dict(), resumed.state_dict()
    assert want_sd.keys() == got_sd.keys() and all(torch.equal(v, got_sd[k]) for k, v in want_sd.items())

    ids = torch.tensor([[1, 504, 33, 890, 12, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        adapter = export_hf(tmp_path / "run", tmp_path / "adapter")
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-random"
        reloaded = PeftModel.from_pretrained(load_model("tiny-random", float32_attention=False), adapter)
        assert torch.equal(reloaded(input_ids=ids).logits, want)


@pytest.mark.slow
def test_cli_export_writes_a_run_dirs_newest_checkpoint(runs, tmp_path):
    from typer.testing import CliRunner

    from polyrl.cli import app

    root, _ = runs
    out = tmp_path / "hf"
    done = CliRunner().invoke(app, ["export", str(root / "ws1"), str(out)])
    assert done.exit_code == 0, done.output
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    again = CliRunner().invoke(app, ["export", str(root / "ws1"), str(out)])
    assert again.exit_code == 2 and "exists and is not empty" in again.output


@pytest.mark.slow
def test_a_one_process_hf_checkpoint_exports_too(tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.checkpoint.store import save_checkpoint
    from polyrl.models.loading import load_tokenizer

    model = _model(5)
    save_checkpoint(tmp_path / "run", 2, model, load_tokenizer("tiny-random"), {}, {"sampler": {}})
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    assert not {"optimizer.pt", "rng.pt", "manifest.json"} & set(os.listdir(out))
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items())

    from polyrl.config import LoraConfig
    from polyrl.models.loading import load_model

    lora = load_model("tiny-random", lora=LoraConfig(r=4, target_modules=["q_proj"]), float32_attention=False)
    torch.nn.init.normal_(lora.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
    save_checkpoint(tmp_path / "lora", 1, lora, load_tokenizer("tiny-random"), {}, {})
    # An alias-built base is unnamed in peft's adapter_config.json (a from_pretrained one is named): name it.
    merged = export_hf(tmp_path / "lora", tmp_path / "merged", "tiny-random", merge_lora=True)
    ids = torch.tensor([[1, 504, 33, 890, 12, 7]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        torch.testing.assert_close(got, lora(input_ids=ids).logits)


def test_a_module_without_an_hf_model_saves_and_loads_but_does_not_export(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    save_sharded(tmp_path / "run/checkpoints/step-3", net, opt, {"step": 3})  # before any step: no optimizer state
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_sharded(tmp_path / "run/checkpoints/step-4", net, opt, {"step": 4}, keep=1)
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == ["step-4"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_sharded(tmp_path / "run/checkpoints/step-4", fresh, fresh_opt) == {"step": 4}
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters(), strict=True))
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    with pytest.raises(ValueError, match="no Hugging Face model"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        load_sharded(tmp_path / "run", fresh)
