"""Randomly initialised models of other architectures than the bundled SmolLM2, written as ordinary Hugging Face
directories (config, safetensors, tokenizer with a chat template): they load through ``model.name=<dir>`` like any
downloaded checkpoint, so the loader, the learner and both decode paths can be exercised offline.

Every model uses the SmolLM2 tokenizer (its 49152 tokens, ChatML template and special ids), so the vocabulary,
and with it the embedding's share of the parameters, is SmolLM2's rather than the family's own. ``tiny`` is a few
million parameters (tests run in seconds); ``1b`` has the widths and head layout of a real model of the family
(named per architecture below) with the layer count trimmed to about a billion parameters. Qwen3 also has
``0.6b`` and ``1.7b``: Qwen3-0.6B and Qwen3-1.7B whole (all 28 layers), which the GPU check builds with Qwen3's
own vocabulary (``make_config(..., vocab_size=151936)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl.models.loading import _quiet_transformers, smollm2_tokenizer_dir

SIZES = ("tiny", "1b")


@dataclass(frozen=True)
class Arch:
    config_class: str
    """Name of the transformers config class."""
    like: str
    """The real model the ``1b`` size copies the widths of."""
    common: dict[str, Any]
    sizes: dict[str, dict[str, Any]]
    random_bias: bool = False
    """Give linear biases random values: transformers initialises them to zero, which would hide a path that
    drops them (Qwen2's q/k/v biases)."""


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
# Gemma 3: global layers at theta 1e6, the sliding-window (local) layers at 1e4.
_GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

ARCHITECTURES: dict[str, Arch] = {
    "llama3": Arch(
        "LlamaConfig", "Llama-3.2-1B",
        dict(rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
             tie_word_embeddings=True),
        {"tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
         "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8)},
    ),
    "qwen2": Arch(
        "Qwen2Config", "Qwen2.5-1.5B (20 of its 28 layers)",
        dict(rope_parameters=_QWEN_ROPE, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
        {"tiny": dict(hidden_size=64, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
         "1b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=20, num_attention_heads=12,
                    num_key_value_heads=2)},
        random_bias=True,
    ),
    "qwen3": Arch(
        "Qwen3Config", "Qwen3-1.7B (18 of its 28 layers)",
        dict(rope_parameters=_QWEN_ROPE, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
        # Qwen3's heads are wider than hidden_size / heads (16 x 128 over 2048): head_dim is set, not derived.
        {"tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32),
         "1b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=18, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128),
         "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128),
         "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128)},
    ),
    "gemma": Arch(
        "GemmaConfig", "Gemma-2B (8 of its 18 layers)",
        dict(max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
             hidden_act="gelu_pytorch_tanh"),
        {"tiny": dict(hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16),
         "1b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=1, head_dim=256)},
    ),
    "gemma3": Arch(
        "Gemma3TextConfig", "Gemma-3-1B",
        dict(rope_parameters=_GEMMA3_ROPE, max_position_embeddings=32768, rms_norm_eps=1e-6,
             tie_word_embeddings=True),
        # The tiny model's window (8) is shorter than its test prompts, so windowed attention is exercised.
        {"tiny": dict(hidden_size=64, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"]),
         "1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512)},
    ),
}


def make_config(arch: str, size: str = "tiny", vocab_size: int = 49152, bos: int = 1, eos: int = 2,
                pad: int = 2) -> Any:
    """The transformers config of ``arch`` at ``size`` with the given vocabulary and special ids."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture '{arch}' (known: {', '.join(ARCHITECTURES)})")
    spec = ARCHITECTURES[arch]
    if size not in spec.sizes:  # every family has SIZES; qwen3 also 0.6b and 1.7b
        raise ValueError(f"unknown size '{size}' for {arch} (known: {', '.join(spec.sizes)})")
    kwargs = {**spec.common, **spec.sizes[size]}
    return getattr(transformers, spec.config_class)(
        vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **kwargs
    )


def write_random_model(
    arch: str, path: str | Path, size: str = "tiny", seed: int = 0, dtype: torch.dtype | None = None
) -> Path:
    """Write a randomly initialised ``arch`` model of ``size`` (``ARCHITECTURES``, ``SIZES``) and the SmolLM2
    tokenizer to the directory ``path``; returns it.

    ``dtype`` is what is stored: by default float32 for ``tiny`` and bfloat16 for ``1b`` (4 GB in float32).
    The weights are created in that dtype, so only one copy of them is ever in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = make_config(arch, size, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, pad)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if ARCHITECTURES[arch].random_bias:
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear) and module.bias is not None:
                        module.bias.normal_(std=0.5)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def parameter_count(arch: str, size: str = "tiny") -> int:
    """Parameters of ``arch`` at ``size`` (tied embeddings counted once), without allocating its weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(arch, size))
    return sum(p.numel() for p in model.parameters())
