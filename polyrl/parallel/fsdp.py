"""The policy sharded over the learner ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), and its whole
weights gathered back for an engine or an evaluation.

Each decoder layer is its own FSDP unit (its weights are gathered just before it runs and freed after), and the
learner's pass (``learner/policy_pass.PolicyPass``) is the root unit holding the rest: embeddings, the tied
output head, the final norm, the critic. Parameters, gradients and optimizer state stay float32 (bf16 compute
is autocast, as in one process), so the sharded update computes what one process computes.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polyrl.models.forward import enable_activation_checkpointing
from polyrl.parallel.shard_gather import full_tensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a causal LM (``model.layers`` of its decoder), LoRA-wrapped or not."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (get_decoder().layers)")
    return list(layers)


def shard_module(
    root: torch.nn.Module,
    policy: torch.nn.Module,
    device: torch.device,
    world_size: int,
    offload: bool = False,
    activation_checkpointing: bool = False,
) -> None:
    """Shard ``root`` (which holds ``policy``) over the process group's ``world_size`` ranks (the run plan's),
    in place: each decoder layer of ``policy`` a unit, ``root`` the unit of what is left. ``offload`` keeps
    shards, gradients and optimizer state in host memory (FSDP2's CPU offload); ``activation_checkpointing``
    recomputes each layer's activations in the backward pass instead of keeping them."""
    mesh = init_device_mesh(device.type, (world_size,))
    offload_policy = CPUOffloadPolicy() if offload and device.type == "cuda" else OffloadPolicy()
    if activation_checkpointing:
        enable_activation_checkpointing(policy)
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, offload_policy=offload_policy)
    fully_shard(root, mesh=mesh, offload_policy=offload_policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss already carries the whole batch's normaliser: gradients add up, not average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum


@torch.no_grad()
def gather_into(sharded: torch.nn.Module, full: torch.nn.Module, trainable_only: bool = False) -> int:
    """Copy the whole weights of ``sharded`` (an all-gather per parameter, every rank taking part) into the
    same-named parameters of the unsharded ``full``; ``trainable_only`` copies only what training changes
    (LoRA adapters). Returns the bytes copied."""
    targets = dict(full.named_parameters())
    copied = 0
    for name, param in sharded.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        value = full_tensor(param)
        targets[name].copy_(value)
        copied += value.numel() * value.element_size()
    return copied


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """``clip_grad_norm_``'s total norm as a number; over sharded (DTensor) gradients it is the whole norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
