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
import functools
import logging
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from polyrl.config import Config

DEVICES = ("auto", "cpu", "cuda")
log = logging.getLogger(__name__)


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


def wants_gpu(name: str) -> bool:
    """Whether ``train.device`` puts the policy on a GPU (``cuda``, or ``auto`` where torch sees one):
    the Ray actors of such a run must each ask for one. Decided without raising, before any device is checked."""
    base = name.split(":", 1)[0]
    return base == "cuda" or (base == "auto" and torch.cuda.is_available())


@functools.cache
def native_bf16(device_type: str) -> bool:
    """Whether this machine runs bfloat16 matmuls in hardware on ``device_type``: a CUDA GPU that supports
    bf16; an x86 CPU with AVX512-BF16 or AMX; a Linux Arm CPU that lists bf16 among its features. Elsewhere (an
    x86 CPU with AVX2 only, say) torch emulates them, many times slower than float32, so float32 is both the
    faster and the exact choice there."""
    if device_type == "cuda":
        # Not counting emulation: a GPU before Ampere runs bf16 through float32 units, slower than float32.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu":
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        try:
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except AttributeError:  # an older torch without the probes: read the kernel's flags below
            pass
    return bool(_cpuinfo_words() & {"avx512_bf16", "amx_bf16", "bf16"})


def _cpuinfo_words() -> set[str]:
    """The words of /proc/cpuinfo (its x86 flags, its Arm features); empty where there is none."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def resolve_bf16(setting: bool | str, device: str) -> bool:
    """A bf16 setting (``model.bf16``, ``engine.bf16_weights``) as a bool: ``auto`` is bf16 where the device
    computes it natively (``native_bf16``), float32 elsewhere; ``true`` on a CPU without native bf16 still runs
    bf16, with a warning that it is slow there."""
    device_type = resolve_device(device).type
    if setting == "auto":
        return native_bf16(device_type)
    if setting and not native_bf16(device_type):
        _warn_emulated_bf16(device_type)
    return bool(setting)


def model_bf16(config: Config) -> bool:
    """``model.bf16`` resolved for ``train.device``: whether the policy computes under bf16 autocast."""
    return resolve_bf16(config.model.bf16, config.train.device)


def engine_bf16(config: Config) -> bool:
    """``engine.bf16_weights`` resolved for ``train.device``: whether the engine samples from a bf16 copy."""
    return resolve_bf16(config.engine.bf16_weights, config.train.device)


@functools.cache
def _warn_emulated_bf16(device_type: str) -> None:  # once per process, however many settings ask
    log.warning("bf16 is set but this %s shows no native bf16 matmuls (AVX512-BF16, AMX, Arm bf16): torch may "
                "emulate them, many times slower than float32; set model.bf16 and engine.bf16_weights to auto or "
                "false", device_type)


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
