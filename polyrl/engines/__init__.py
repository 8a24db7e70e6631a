"""Generation engines behind one interface, ``Engine`` (engines/protocol.py): ``generate`` returning per-prompt
groups of ``Completion`` (token ids as sampled, behaviour log-probs, finished flag), ``sync()`` after each
learner update, ``release_memory()`` before it. ``make_engine`` picks one from ``engine.kind``."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import Config
from polyrl.engines.hf import HFEngine
from polyrl.engines.protocol import Engine
from polyrl.engines.recompute import RecomputeLogprobs
from polyrl.models.device import engine_bf16, model_bf16

VLLM_INSTALL_HINT = (
    "engine.kind is 'vllm' but vllm is not installed: in a separate virtual environment run "
    "pip install torch==2.13.0 && pip install 'polyrl[vllm]' (from a checkout: -e '.[vllm]'), "
    "then pip uninstall -y torchvision torchaudio torchcodec (docs/systems.md)"
)


class EngineUnavailableError(RuntimeError):
    """The configured engine cannot run in this environment."""


def make_engine(config: Config, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Engine:
    """The engine ``config.engine.kind`` names, sampling from ``policy``; with ``engine.recompute_logprobs``
    its behaviour log-probs are replaced by the policy's own."""
    cfg = config.engine
    if cfg.kind == "vllm":
        try:
            import vllm  # noqa: F401  (checked here so the error names the fix, not a deep import)
        except ImportError:
            raise EngineUnavailableError(VLLM_INSTALL_HINT) from None
        from polyrl.engines.vllm import VLLMEngine  # imports vllm, an optional extra

        engine: Engine = VLLMEngine(
            policy, tokenizer, config.model.name, cfg.vllm, lora_rank=config.model.lora.r if config.model.lora else 0,
            seed=config.train.seed,
        )
    else:
        engine = HFEngine(
            policy, tokenizer, bf16=model_bf16(config), bf16_weights=engine_bf16(config), fast_decode=cfg.fast_decode,
            native_kernels=cfg.native_kernels, int8_weights=cfg.int8_weights,
        )
    if cfg.recompute_logprobs:
        engine = RecomputeLogprobs(engine, policy, bf16=model_bf16(config))
    return engine
