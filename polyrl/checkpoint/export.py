"""A checkpoint as a Hugging Face directory (``polyrl export``): config.json, model.safetensors and the tokenizer,
which ``AutoModelForCausalLM.from_pretrained`` loads; for a LoRA policy the adapter (adapter_config.json,
adapter_model.safetensors) or, with ``merge_lora``, the merged weights. Runs in one process, no process group:
DCP reads every rank's shards into whole tensors.

A sharded checkpoint of a full policy needs nothing else (its config and tokenizer are in ``hf/``); the weights
go into a model built on the meta device, so no memory is spent on an initialisation that is overwritten. A
LoRA checkpoint holds only the adapter, so the base model (by name, or a model in memory) supplies the rest.
Today's one-process checkpoints are already HF directories; they are copied the same way.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from polyrl.checkpoint.sharded import HF_DIR, META, is_sharded, read_model_tensors
from polyrl.checkpoint.store import MANIFEST, latest_checkpoint, verify_checkpoint
from polyrl.models.loading import load_model, load_tokenizer

log = logging.getLogger(__name__)

def resolve_checkpoint(source: Path) -> Path:
    """A checkpoint directory (verified), or the newest valid checkpoint of a run directory."""
    source = Path(source)
    if (source / MANIFEST).is_file():
        problem = verify_checkpoint(source)
        if problem is not None:
            raise ValueError(problem)
        return source
    run_dir = source.parent if source.name == "checkpoints" else source
    found = latest_checkpoint(run_dir)
    if found is None:
        raise ValueError(f"{source}: no valid checkpoint here (neither a checkpoint nor a run directory with one)")
    return found


def export_hf(
    checkpoint_dir: Path,
    out_dir: Path,
    base_model_name_or_model: str | torch.nn.Module | None = None,
    *,
    merge_lora: bool = False,
) -> Path:
    """Write ``checkpoint_dir`` (a checkpoint, or a run directory: its newest valid one) as an HF directory at
    ``out_dir``, which must not exist or be empty; written beside it and renamed, so it is whole or absent.

    ``base_model_name_or_model``: the base model alias / HF directory, or a model in memory (copied, never
    changed); default the one the checkpoint records. Needed for LoRA weights and for a tokenizer the
    checkpoint does not hold."""
    ckpt = resolve_checkpoint(checkpoint_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not empty")
    if is_sharded(ckpt):
        model, tokenizer = _from_sharded(ckpt, base_model_name_or_model, merge_lora)
    else:
        model, tokenizer = _from_hf_checkpoint(ckpt, base_model_name_or_model, merge_lora)
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # peft's default looks the base's config up (on the Hub for a name it cannot find) to see whether the
        # vocabulary grew; training never resizes it, so skip the lookup.
        model.save_pretrained(tmp, **({"save_embedding_layers": False} if _is_peft(model) else {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _from_sharded(ckpt: Path, base: str | torch.nn.Module | None, merge: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = json.loads((ckpt / META).read_text())
    base = base if base is not None else meta.get("base_model")
    prefix = meta.get("policy_prefix")
    if prefix is None:
        raise ValueError(f"{ckpt}: its model held no Hugging Face model, so there is nothing to export")
    # The learner's root may hold more than the policy (a critic): keep the policy's tensors, in its own names.
    tensors = {k.removeprefix(prefix): v for k, v in read_model_tensors(ckpt).items() if k.startswith(prefix)}
    if meta.get("peft"):
        model = _peft_model(ckpt / HF_DIR, base)
        _load_into(model, tensors, ckpt, every_trainable=True)
        if merge:
            model = model.merge_and_unload()
    else:
        config = AutoConfig.from_pretrained(ckpt / HF_DIR)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(tensors, strict=False, assign=True)
        model.tie_weights()  # assign=True gave the tied head its own copy; share it again
        absent = [k for k, v in model.state_dict().items() if v.is_meta]
        if absent:  # frozen parameters are not checkpointed: the base model supplies them
            model = _base_model(base, f"{ckpt} lacks frozen weights ({', '.join(absent[:3])}...)")
            _load_into(model, tensors, ckpt, every_trainable=False)
    return model, _tokenizer(ckpt / HF_DIR, base)


def _is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _base_model(base: str | torch.nn.Module | None, why: str) -> torch.nn.Module:
    if isinstance(base, torch.nn.Module):
        return copy.deepcopy(base)
    if not base:
        raise ValueError(f"{why}: name the base model (export's base_model_name_or_model, polyrl export --base)")
    return load_model(base, float32_attention=False)


def _peft_model(hf_dir: Path, base: str | torch.nn.Module | None) -> torch.nn.Module:
    from peft import PeftConfig, PeftModel, get_peft_model

    model = _base_model(base, f"{hf_dir.parent} holds a LoRA adapter")
    if isinstance(model, PeftModel):  # a LoRA policy in memory: its adapters get the checkpoint's weights
        return model
    config = PeftConfig.from_pretrained(hf_dir)
    recorded = base if isinstance(base, str) else config.base_model_name_or_path
    with warnings.catch_warnings():  # its warning that it renamed the base: set back just below
        warnings.simplefilter("ignore", UserWarning)
        model = get_peft_model(model, config)
    # get_peft_model renames the base after the model's from_pretrained path (none for an alias): keep the name,
    # so the exported adapter_config.json says which base to load it on.
    model.peft_config[model.active_adapter].base_model_name_or_path = recorded
    return model


def _load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ckpt: Path, every_trainable: bool) -> None:
    """Copy the checkpoint's tensors in: each must name a weight of the model, and (``every_trainable``, an
    adapter) every trainable parameter must be among them."""
    _, unexpected = model.load_state_dict(tensors, strict=False)
    uncovered = [n for n, p in model.named_parameters() if p.requires_grad and n not in tensors] * every_trainable
    if unexpected or uncovered:
        raise ValueError(f"{ckpt}: weights do not match the model (not in the model: {unexpected[:3]}, "
                         f"not in the checkpoint: {uncovered[:3]})")


def _tokenizer(hf_dir: Path, base: str | torch.nn.Module | None) -> Any:
    from transformers import AutoTokenizer

    if (hf_dir / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(hf_dir)
    name = base if isinstance(base, str) else getattr(getattr(base, "config", None), "_name_or_path", None)
    if name:
        try:
            return load_tokenizer(name)
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer exported: %s", exc)
            return None
    log.warning("no tokenizer exported: the checkpoint holds none and no base model is named")
    return None


def _from_hf_checkpoint(ckpt: Path, base: str | torch.nn.Module | None, merge: bool):
    """A one-process checkpoint (``checkpoint/store.py``): HF weights already; loaded and saved again, so the
    output holds only what an HF directory holds (no optimizer, RNG or manifest)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_config = ckpt / "adapter_config.json"
    if adapter_config.is_file():
        from peft import PeftModel

        # Its base by the name the adapter records (an alias such as tiny-random works: load_model resolves it).
        recorded = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        model = PeftModel.from_pretrained(_base_model(base or recorded, f"{ckpt} holds a LoRA adapter"), ckpt)
        if merge:
            model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(ckpt)
