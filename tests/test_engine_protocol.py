"""Every engine implements ``Engine`` (engines/protocol.py) with the protocol's own method signatures."""

import inspect

from polyrl.engines.hf import HFEngine
from polyrl.engines.protocol import Engine
from polyrl.engines.recompute import RecomputeLogprobs
from polyrl.engines.vllm import VLLMEngine
from polyrl.models.loading import TINY_ALIAS, load_tokenizer, tiny_random_model
from polyrl.runtime.partial import PartialEngine

METHODS = ("generate", "sync", "release_memory")


def test_each_engine_class_has_the_protocol_methods_with_its_parameters():
    for cls in (HFEngine, VLLMEngine, RecomputeLogprobs, PartialEngine):
        for name in METHODS:
            wanted = list(inspect.signature(getattr(Engine, name)).parameters)
            have = list(inspect.signature(getattr(cls, name)).parameters)
            positional = [p for p in wanted if p not in ("hooks",)]
            assert have[: len(positional)] == positional, f"{cls.__name__}.{name}{have} against Engine.{name}{wanted}"


def test_built_engines_are_engines_and_sample_through_the_protocol():
    tokenizer = load_tokenizer(TINY_ALIAS)
    model = tiny_random_model(seed=0, vocab_size=len(tokenizer))
    hf = HFEngine(model, tokenizer, bf16=False)
    wrapped = [hf, RecomputeLogprobs(hf, model, bf16=False), PartialEngine(hf, 2, lambda: 0)]
    for engine in wrapped:
        assert isinstance(engine, Engine)
        engine.sync()
        engine.release_memory(until_used=True)
        groups = engine.generate([[1, 2, 3]], n=2, max_new_tokens=3, temperature=1.0, seed=0)
        assert len(groups) == 1 and len(groups[0]) == 2
        assert all(1 <= len(c.token_ids) <= 3 and len(c.logprobs) == len(c.token_ids) for c in groups[0])
    assert not isinstance(object(), Engine)
