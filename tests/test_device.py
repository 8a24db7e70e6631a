"""models/device.py and the device plumbing: ``train.device`` resolution, batches moved whole, the engine's
CPU path unchanged on an explicit cpu device, and the choices a non-CPU device makes (checked on ``meta``,
which needs no GPU). The GPU paths themselves need a GPU to run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMOKE

from polyrl.config import ConfigError
from polyrl.config_check import load_config
from polyrl.engines.hf import HFEngine
from polyrl.learner.batch import Batch, collate
from polyrl.models import device as dev
from polyrl.models.forward import autocast_context
from polyrl.models.loading import load_model, tiny_random_model
from polyrl.train import teachers
from polyrl.types import Trajectory

# --- bf16 where the hardware computes it ------------------------------------------------------------------------


def _cpu(monkeypatch, machine: str, avx512_bf16: bool = False, amx: bool = False, cpuinfo: str = "") -> None:
    dev.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(dev, "_cpuinfo_words", lambda: set(cpuinfo.split()))


@pytest.mark.parametrize(("machine", "avx512_bf16", "amx", "cpuinfo", "native"), [
    ("x86_64", True, False, "", True),                     # AVX512-BF16 (Zen 4 and later, Cooper Lake)
    ("x86_64", False, True, "", True),                     # AMX (Sapphire Rapids and later)
    ("x86_64", False, False, "flags : avx2 fma", False),   # AVX2 only: torch emulates bf16
    ("aarch64", False, False, "Features : fp asimd bf16 sve", True),
    ("aarch64", False, False, "Features : fp asimd", False),
])
def test_native_bf16_on_the_cpu_follows_the_hardware(monkeypatch, machine, avx512_bf16, amx, cpuinfo, native):
    _cpu(monkeypatch, machine, avx512_bf16, amx, cpuinfo)
    try:
        assert dev.native_bf16("cpu") is native
        assert dev.resolve_bf16("auto", "cpu") is native
        # An explicit setting wins either way.
        assert dev.resolve_bf16(True, "cpu") is True and dev.resolve_bf16(False, "cpu") is False
    finally:
        dev.native_bf16.cache_clear()


@pytest.mark.parametrize(("compute", "native"), [(8, True), (7, False)])  # Ampere and later; Volta emulates
def test_native_bf16_on_a_gpu_does_not_count_emulation(monkeypatch, compute, native):
    dev.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or compute >= 8)
    try:
        assert dev.native_bf16("cuda") is native
    finally:
        dev.native_bf16.cache_clear()


def test_auto_is_the_default_and_resolves_per_setting(monkeypatch):
    _cpu(monkeypatch, "x86_64", cpuinfo="flags : avx2")
    try:
        config = load_config(SMOKE, ["model.bf16=auto"])
        assert config.engine.bf16_weights == "auto"
        assert dev.model_bf16(config) is False and dev.engine_bf16(config) is False
        forced = load_config(SMOKE, ["model.bf16=true", "engine.bf16_weights=true"])
        assert dev.model_bf16(forced) is True and dev.engine_bf16(forced) is True
    finally:
        dev.native_bf16.cache_clear()


def test_forcing_bf16_where_it_is_emulated_warns_once(monkeypatch, caplog):
    _cpu(monkeypatch, "x86_64", cpuinfo="flags : avx2")
    dev._warn_emulated_bf16.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="polyrl.models.device"):
            dev.resolve_bf16(True, "cpu")
            dev.resolve_bf16(True, "cpu")
            dev.resolve_bf16("auto", "cpu")
        warnings = [r.message for r in caplog.records if "no native bf16" in r.message]
        assert len(warnings) == 1 and "model.bf16" in warnings[0]
    finally:
        dev.native_bf16.cache_clear()
        dev._warn_emulated_bf16.cache_clear()


def test_a_setting_that_is_neither_bool_nor_auto_names_the_key():
    with pytest.raises(ConfigError, match="model.bf16"):
        load_config(SMOKE, ["model.bf16=fast"])


# --- resolve_device ---------------------------------------------------------------------------------------------


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_is_the_cpu_on_this_machine():
    assert dev.resolve_device("auto").type == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_line_naming_the_setting(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="train.device") as err:
        dev.resolve_device(name)
    assert "\n" not in str(err.value) and "cpu or auto" in str(err.value)


@pytest.mark.parametrize("name", ["gpu", "cpu:0", "tpu", ""])
def test_unknown_names_are_rejected(name):
    with pytest.raises(ValueError, match="train.device"):
        dev.resolve_device(name)


def test_cuda_resolves_to_the_current_gpu_when_one_is_seen(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)


# --- small helpers ----------------------------------------------------------------------------------------------


def test_module_device_and_autocast_device_type():
    model = tiny_random_model(0, vocab_size=64)
    assert dev.module_device(model) == torch.device("cpu")
    assert dev.module_device(torch.nn.ReLU()) == torch.device("cpu")  # no tensors: the CPU
    assert dev.module_device(torch.nn.Linear(2, 2, device="meta")).type == "meta"
    assert dev.autocast_device_type(model) == "cpu"
    assert dev.autocast_device_type(torch.empty(1, device="meta")) == "meta"
    assert dev.autocast_device_type("cuda:1") == "cuda"


def test_bf16_autocast_on_the_cpu_is_what_forward_used_before():
    with autocast_context(True):  # the old one-argument call still means the CPU
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with dev.bf16_autocast("cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")


def test_to_device_and_host_lists():
    t = dev.to_device([3, 1, 2], "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
    tok = torch.tensor([5, 49151, 262143])
    lp = torch.tensor([-0.1, -2.5, -13.0625], dtype=torch.float32)
    flags = torch.tensor([True, False, True])
    per_tensor = [tok.tolist(), lp.tolist(), flags.tolist()]
    assert dev.to_host_lists(tok, lp, flags) == per_tensor
    # The one-copy path (a GPU's) gives the same Python values and types.
    one = dev.to_host_lists(tok, lp, flags, one_copy=True)
    assert one == per_tensor
    assert [type(v) for v in (one[0][0], one[1][0], one[2][0])] == [int, float, bool]


# --- Batch.to ---------------------------------------------------------------------------------------------------


def _trajectory(prompt: list[int], response: list[int], advantage: float) -> Trajectory:
    n = len(prompt) + len(response)
    return Trajectory(
        task="t", item_id=0, group_id=0, input_ids=prompt + response, loss_mask=[0] * len(prompt) + [1] * len(response),
        logprobs=[-0.5] * n, versions=[0] * n, advantage=advantage,
    )


def _batch() -> Batch:
    return collate([_trajectory([1, 2, 3], [4, 5], 1.0), _trajectory([6], [7, 8, 9], -1.0)], pad_id=0)


def test_batch_to_moves_every_tensor():
    batch = _batch()
    assert batch.to("cpu") is batch and batch.device == torch.device("cpu")
    moved = batch.to(torch.device("meta"))
    for f in Batch.__dataclass_fields__:
        before, after = getattr(batch, f), getattr(moved, f)
        assert after.device.type == "meta", f
        assert (after.shape, after.dtype) == (before.shape, before.dtype), f
    assert moved.device.type == "meta" and batch.device.type == "cpu"  # the original is left where it was


def test_batch_rows_is_unchanged_by_reading_usage_back_once():
    batch = _batch()
    sub = batch.rows(slice(1, 2))  # one prompt token and three response tokens: padding cut on both sides
    assert sub.input_ids.tolist() == [[6, 7, 8, 9]] and sub.targets.tolist() == [[7, 8, 9]]


# --- models on a device -----------------------------------------------------------------------------------------


def test_load_model_moves_the_built_model():
    model = load_model("tiny-random", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.device.type for p in load_model("tiny-random").parameters()} == {"cpu"}


def test_teachers_are_loaded_on_the_students_device(monkeypatch):
    config = load_config(SMOKE, ["algorithm.regularisers.distill_coef=0.5", "tasks.0.teacher=tiny-random"])
    placed = []

    def fake_load(name, lora=None, seed=0, device=None, **kw):
        placed.append(device)
        return tiny_random_model(seed)

    monkeypatch.setattr(teachers, "load_model", fake_load)
    student = tiny_random_model(0).to("meta")
    out = teachers.load_teachers(config, student)
    assert list(out) == ["chain_sum"] and placed == [torch.device("meta")]


# --- the engine -------------------------------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]


def _samples(engine: HFEngine, **kw) -> list:
    groups = engine.generate(PROMPTS, n=3, max_new_tokens=10, seed=5, **kw)
    return [(c.token_ids, c.logprobs, c.finished) for g in groups for c in g]


@pytest.mark.slow
def test_engine_on_an_explicit_cpu_device_keeps_the_fused_path_and_its_outputs(tok):
    cpu = dev.resolve_device("cpu")
    placed = HFEngine(load_model("tiny-random", seed=0, device=cpu), tok, bf16=True, bf16_weights=True)
    plain = HFEngine(load_model("tiny-random", seed=0), tok, bf16=True, bf16_weights=True)
    assert placed.device == cpu and placed.fast is not None and not placed.mask_4d
    assert placed.native_sampling == plain.native_sampling
    assert _samples(placed) == _samples(plain)
    assert _samples(placed, temperature=0.7, top_p=0.9) == _samples(plain, temperature=0.7, top_p=0.9)


def test_engine_off_the_cpu_takes_the_transformers_path(tok):
    # meta stands in for a GPU: the constructor's choices only, nothing is computed.
    engine = HFEngine(load_model("tiny-random", device="meta"), tok, bf16=True, bf16_weights=True)
    assert engine.device.type == "meta" and engine.fast is None and not engine.native_sampling and engine.mask_4d
    assert engine.head_weight.device.type == "meta"
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}


def test_windowed_attention_keeps_transformers_masks_off_the_cpu(tok):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16)
    engine = HFEngine(Gemma3ForCausalLM(cfg).to("meta"), tok, bf16=True)
    assert engine.fast is None and not engine.mask_4d


@pytest.mark.slow
@pytest.mark.parametrize("bf16_weights", [False, True])
def test_decode_mask_as_4d_boolean_samples_the_same(tok, bf16_weights):
    """The GPU's decode-step mask (prebuilt [B, 1, 1, K] booleans), run here on the CPU against the 2-D one."""
    model = load_model("tiny-random", seed=0)
    ref = HFEngine(model, tok, bf16=False, bf16_weights=bf16_weights, fast_decode=False)
    four_d = HFEngine(model, tok, bf16=False, bf16_weights=bf16_weights, fast_decode=False)
    four_d.mask_4d = True
    ref.stop_ids = four_d.stop_ids = set(range(0, len(tok), 40))  # rows finish and are dropped mid-generation
    a, b = _samples(ref), _samples(four_d)
    assert [x[0] for x in a] == [x[0] for x in b] and [x[2] for x in a] == [x[2] for x in b]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(x[1]), torch.tensor(y[1]), atol=1e-5)


# --- guard ------------------------------------------------------------------------------------------------------

HARD_CODED_CPU_AUTOCAST = re.compile(
    r"""torch\.autocast\(\s*(device_type\s*=\s*)?["']cpu["']|torch\.cpu\.amp\.autocast|autocast\(\s*["']cpu["']"""
)


def test_cpu_autocast_is_not_hard_coded_outside_the_device_helper():
    """Autocast must follow the tensors' device (``models/device.py``), or a GPU run silently runs float32."""
    helper = ROOT / "polyrl" / "models" / "device.py"
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in ("polyrl", "benchmarks")
        for path in sorted(Path(ROOT / folder).rglob("*.py"))
        if path != helper
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if HARD_CODED_CPU_AUTOCAST.search(line)
    ]
    assert not offenders, f"torch.autocast on 'cpu' hard-coded at {offenders}; use models/device.bf16_autocast"
