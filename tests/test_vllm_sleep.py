"""vLLM's sleep mode for a colocated engine (``engine.vllm.sleep_mode``): the order of sleep, wake-up and
weight reload around each update, checked against a recording stand-in for vLLM's ``LLM`` (vLLM itself sleeps
on CUDA only, and has not run on a GPU here)."""

import pytest
import torch

from polyrl.engines.vllm import VLLMEngine, sleep_level
from polyrl.models.loading import TINY_ALIAS, load_model


class RecordingLLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def _engine(level: int) -> VLLMEngine:
    engine = object.__new__(VLLMEngine)  # the real class without starting vLLM
    engine.policy, engine.is_lora, engine.tied, engine.dtype = load_model(TINY_ALIAS), False, False, torch.bfloat16
    engine.llm, engine.sleep_level, engine.asleep = RecordingLLM(), level, False
    return engine


def test_a_sleeping_engine_frees_memory_for_the_update_and_wakes_weights_before_kv_cache():
    engine = _engine(level=2)
    engine.release_memory()
    engine.release_memory()  # twice in a row (an update with nothing to learn) sleeps once
    engine.sync()
    n = len(list(engine.policy.parameters()))
    assert engine.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights", n),
                                ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    assert not engine.asleep


def test_without_sleep_mode_the_engine_keeps_its_memory():
    engine = _engine(level=0)
    engine.release_memory()
    engine.sync()
    assert [c[0] for c in engine.llm.calls] == ["reload_weights", "reset_prefix_cache"]


def test_sleep_level_keeps_lora_base_weights_and_refuses_a_cpu():
    assert sleep_level(False, False, on_gpu=False) == 0
    assert sleep_level(True, False, on_gpu=True) == 2  # the sync rewrites every weight
    assert sleep_level(True, True, on_gpu=True) == 1  # the sync rewrites only the adapter
    with pytest.raises(ValueError, match="engine.vllm.sleep_mode"):
        sleep_level(True, False, on_gpu=False)
