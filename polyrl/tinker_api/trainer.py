"""A Tinker training model on polyrl's learner pieces: the policy (full or LoRA through peft, as
``models/loading.py`` builds it), log-probs from polyrl's learner pass (``passes.py``), Tinker's summed
losses, gradients accumulated across ``forward_backward`` calls, and AdamW stepped with the hyperparameters each
``optim_step`` carries.

Checkpoints are model directories polyrl itself loads (``load_model``): a full model as a Hugging Face
directory, a LoRA model as a peft adapter directory naming its base, with ``optimizer.pt`` beside them for
training checkpoints and ``tinker.json`` for what the server needs to rebuild the model (``load_weights`` of
``checkpoint/store.py`` reads the weights back into it).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.checkpoint.store import load_weights
from polyrl.config import LoraConfig
from polyrl.models.loading import load_model
from polyrl.tinker_api.losses import check_inputs, check_loss
from polyrl.tinker_api.passes import datum_logprobs, passes, start
from polyrl.tinker_api.wire import Datum, WireError

LORA_ALPHA = 32.0
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class LoraSpec:
    """Tinker's LoRA options: the rank and which parts of the model get adapters."""

    rank: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    seed: int | None = None

    def polyrl_config(self) -> LoraConfig:
        targets = (ATTENTION if self.train_attn else []) + (MLP if self.train_mlp else [])
        targets += ["lm_head"] if self.train_unembed else []
        if not targets:
            raise WireError("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
        # bf16_base off: an adapted head may share its weight with the input embedding (frozen_bases_to_bf16).
        return LoraConfig(r=self.rank, alpha=LORA_ALPHA, dropout=0.0, target_modules=targets, bf16_base=False)


def build_policy(base_model: str, lora: LoraSpec | None, bf16: bool) -> PreTrainedModel:
    """The base model with fresh adapters (seeded by ``lora.seed``), or the whole model trainable."""
    with torch.random.fork_rng():
        torch.manual_seed(lora.seed if lora is not None and lora.seed is not None else 0)
        model = load_model(base_model, lora.polyrl_config() if lora else None, bf16=bf16)
    if lora is None:
        model.requires_grad_(True)
    elif bf16:
        frozen_bases_to_bf16(model)
    return model.eval()


def frozen_bases_to_bf16(model: PreTrainedModel) -> None:
    """Store the frozen base weights of adapted layers in bfloat16, as polyrl's LoRA runs do
    (``models/loading.frozen_base_to_bf16``: autocast would cast them for every matmul anyway), except a base
    weight shared with the input embedding (an adapted tied head), which stays float32 for the lookups."""
    embedding = model.get_input_embeddings().weight
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and not base.weight.requires_grad and base.weight is not embedding:
            base.weight.data = base.weight.data.to(torch.bfloat16)


class TrainingModel:
    """One Tinker training run: its policy, its optimizer and the gradients accumulated since the last step."""

    def __init__(self, model_id: str, base_model: str, policy: PreTrainedModel, lora: LoraSpec | None,
                 bf16: bool, pad_id: int) -> None:
        self.model_id, self.base_model, self.policy, self.lora = model_id, base_model, policy, lora
        self.bf16, self.pad_id = bf16, pad_id
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # Tinker's defaults; every optim_step sets its own values before stepping.
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                                           fused=True)
        self.steps = 0
        self.version = 0
        """Bumped whenever the weights change (a step, a load): a sampler snapshot of the same version is current."""

    # --- forward / backward -------------------------------------------------------------------------------

    def forward(self, data: list[Datum], loss_fn: str, config: dict, backward: bool) -> tuple[list[dict], dict]:
        """Per-datum outputs (``logprobs``, ``elementwise_loss``) and metrics (``loss:sum``); with ``backward``
        the gradient of the summed loss is added to the parameters' gradients."""
        if not data:
            raise WireError("forward_backward: no data")
        loss = check_loss(loss_fn, config)
        for row, datum in enumerate(data):
            if not datum.tokens:
                raise WireError(f"data[{row}]: model_input is empty")
            check_inputs(loss_fn, loss, row, len(datum.tokens), datum.inputs)
            targets = datum.inputs["target_tokens"]
            vocab = self.policy.get_output_embeddings().out_features
            if targets.is_floating_point() or targets.min() < 0 or targets.max() >= vocab:
                raise WireError(f"data[{row}].loss_fn_inputs['target_tokens']: token ids must be integers in "
                                f"[0, {vocab})")
        outputs: list[dict] = []
        total = 0.0
        for part in passes(data):
            batch = [data[i] for i in part]
            starts = [start(d, loss.gradient_weight) for d in batch]
            logprobs = datum_logprobs(self.policy, batch, starts, self.bf16, self.pad_id, grad=backward)
            part_loss = logprobs[0].new_zeros(())
            for datum, lp in zip(batch, logprobs, strict=True):
                inputs = {k: v.to(lp.device, torch.float32) for k, v in datum.inputs.items() if k != "target_tokens"}
                elementwise = loss.fn(lp, inputs, config)
                part_loss = part_loss + elementwise.sum()
                outputs.append({"logprobs": lp.detach(), "elementwise_loss": elementwise.detach()})
            if backward and part_loss.requires_grad:
                part_loss.backward()
            total += float(part_loss.detach())
        return outputs, {"loss:sum": total}

    # --- the optimizer --------------------------------------------------------------------------------------

    def optim_step(self, params: dict[str, Any]) -> dict[str, float]:
        """One AdamW step (decoupled weight decay, as ``torch.optim.AdamW``) with ``params`` (Tinker's
        ``AdamParams``), then the gradients are cleared."""
        lr = float(params.get("learning_rate", 1e-4))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95)))
            group["eps"] = float(params.get("eps", 1e-12))
            group["weight_decay"] = float(params.get("weight_decay", 0.0))
        clip = float(params.get("grad_clip_norm", 0.0))
        grads = [p for p in self.params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else math.inf)) if grads else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.version += 1
        return {"grad_norm:mean": norm}

    # --- checkpoints ----------------------------------------------------------------------------------------

    def save(self, path: Path, tokenizer: PreTrainedTokenizerBase, optimizer: bool, meta: dict[str, Any]) -> None:
        """Write the weights (and the optimizer's state) to ``path`` through a temporary directory beside it,
        so a checkpoint is whole or absent."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
        try:
            if self.lora is None:
                self.policy.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            else:  # the adapters only: an adapted head's tied embedding is the base model's, unchanged
                self.policy.save_pretrained(tmp, save_embedding_layers=False)
            if optimizer:
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            info = {"base_model": self.base_model, "lora": asdict(self.lora) if self.lora else None,
                    "steps": self.steps, "optimizer": optimizer, **meta}
            (tmp / "tinker.json").write_text(json.dumps(info, indent=1))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load_optimizer(self, path: Path) -> None:
        state = path / "optimizer.pt"
        if not state.exists():
            raise WireError(f"{path.name}: the checkpoint holds no optimizer state (saved by "
                            "save_weights_for_sampler?); load it without the optimizer")
        self.optimizer.load_state_dict(torch.load(state, weights_only=True))


def checkpoint_info(path: Path) -> dict[str, Any]:
    info = path / "tinker.json"
    if not info.exists():
        raise WireError(f"no checkpoint at {path}")
    return json.loads(info.read_text())


def load_policy(path: Path, bf16: bool) -> tuple[PreTrainedModel, str, LoraSpec | None]:
    """The trainable policy a checkpoint holds, its base model's name and its LoRA options."""
    info = checkpoint_info(path)
    lora = LoraSpec(**info["lora"]) if info["lora"] else None
    model = build_policy(info["base_model"], lora, bf16)
    load_weights(model, path)
    return model, info["base_model"], lora
