"""A device named on the command line or in a config, refused in one line where this host has no such device."""

from __future__ import annotations

from typing import Any


class DeviceError(RuntimeError):
    """The named device does not exist here; the message says which and what to use instead."""


def checked_device(name: str) -> Any:
    """torch.device(name), refused (DeviceError) when it names a CUDA device this torch cannot reach: a CPU-only
    build, no GPU visible, or an index past the visible ones. Every role and `eval` goes through here, so a
    wrong `--device` is one line before any model loads, not a traceback from the first tensor moved there. Only cpu
    (index 0) and cuda devices run anything here: `meta` holds no data and `cpu:7` does not exist."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise DeviceError(f"device {name!r} is not a device torch knows ({e}); use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # meta holds no data (weights loaded there are a SafetensorError)
        raise DeviceError(
            f"device {name!r}: a {device.type} device cannot run a role or eval here; use cpu, cuda or cuda:N"
        )
    if device.type == "cpu" and device.index not in (None, 0):  # one CPU device: torch refuses cpu:7 only at use
        raise DeviceError(f"device {name!r}: there is one CPU device (cpu, or cpu:0); use --device cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceError(f"device {name!r}: no CUDA device here ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    return device
