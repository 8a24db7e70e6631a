"""Where models and tensors live (``train.device``), and the few helpers that keep device-specific choices in
one place: which autocast to enter, and how small host-side data reaches the device (and results come back)
without stalling it.

On a GPU the host must not wait for the device inside a loop: ``torch.tensor(data, device="cuda")`` and every
``.tolist()``, ``.item()`` or ``int(t)`` of a device tensor wait until the device has run everything queued
before them. ``to_device`` copies host data without that wait; ``to_host_lists`` brings several results back
in one copy. On the CPU both are the plain operations.
"""

from __future__ import annotations

import contextlib

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a ``torch.device``: ``auto`` is cuda when torch sees a GPU, else cpu; ``cuda`` (or
    ``cuda:N``) without a GPU is an error naming the setting. A bare ``cuda`` resolves to the current GPU's index,
    so it compares equal to the devices of the tensors placed there."""
    base = name.split(":", 1)[0]
    if base not in DEVICES or (":" in name and base != "cuda"):
        raise ValueError(f"train.device: '{name}' is not one of {', '.join(DEVICES)}")
    if base == "auto":
        base = name = "cuda" if torch.cuda.is_available() else "cpu"
    if base == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"train.device is '{name}' but torch sees no CUDA GPU (torch {torch.__version__}); "
            "set train.device to cpu or auto"
        )
    device = torch.device(name)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); cpu for a module without tensors."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def autocast_device_type(x: torch.Tensor | torch.nn.Module | torch.device | str) -> str:
    """The ``device_type`` that ``torch.autocast`` takes for computations on ``x`` ("cpu", "cuda", ...)."""
    if isinstance(x, torch.nn.Module):
        return module_device(x).type
    if isinstance(x, torch.Tensor):
        return x.device.type
    return torch.device(x).type


def bf16_autocast(device_type: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device_type`` (float32 weights stay float32; matmuls run in bf16), or nothing."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``. To a GPU the copy is queued (non-blocking from host
    memory is safe in that direction: the source is staged before the call returns), so the host does not wait
    for the device's queued work as a blocking copy would."""
    host = torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def to_host_lists(*tensors: torch.Tensor, one_copy: bool | None = None) -> list[list]:
    """``[t.tolist() for t in tensors]`` for 1-D tensors of one length, in one device-to-host copy when they are
    on a GPU (a single wait for the device instead of one per tensor; ``one_copy`` forces either way). Integer
    tensors come back as ints; their values must be exact in float64 (token ids, row indices)."""
    if one_copy is None:
        one_copy = any(t.device.type != "cpu" for t in tensors)
    if not one_copy:
        return [t.tolist() for t in tensors]
    host = torch.stack([t.double() for t in tensors]).cpu().tolist()
    return [_as_dtype(values, t.dtype) for t, values in zip(tensors, host, strict=True)]


def _as_dtype(values: list[float], dtype: torch.dtype) -> list:
    if dtype == torch.bool:
        return [bool(v) for v in values]
    return values if dtype.is_floating_point else [int(v) for v in values]
