"""Device helpers shared by the engine, the drafter timer and calibration.

On an accelerator, kernels run asynchronously: a clock read right after a call measures the
launch, and the work is booked to whatever synchronises next (the engine's accept step reads
accepted tokens to the host, so verify time would be booked as accept time). Every timing
that can see accelerator work calls ``synchronize(device)`` before reading the clock.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device", "synchronize"]


def synchronize(device: torch.device | str | None) -> None:
    """Wait until the work queued on ``device`` is done; a no-op on the CPU (and meta)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    torch.accelerator.synchronize(device)


def resolve_device(text: str | torch.device) -> torch.device:
    """A device the user named (``--device``), refused with a clear error when it does not
    exist on this machine: ``cpu``, ``cuda``, ``cuda:1``, or the local accelerator's type."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {text!r} is not a device name ({err}); use cpu, cuda or cuda:N") from None
    if device.type in ("cpu", "meta"):
        return device
    local = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if local is None or local.type != device.type:
        have = f"its accelerator is {local.type}" if local is not None else "it has no accelerator"
        raise ValueError(f"--device {text}: this machine has no {device.type} device ({have}); use --device cpu")
    if device.index is not None and device.index >= torch.accelerator.device_count():
        raise ValueError(f"--device {text}: there are {torch.accelerator.device_count()} {device.type} devices "
                         f"(indices from 0)")
    return device
