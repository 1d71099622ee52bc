# >>> ch04 file: copies between the host and the device
"""Copies between the host and the device that never make the host wait.

    to_host    a step's tokens back to the host: on a GPU a non-blocking copy into pinned memory, behind
               the step on its stream, with an event that says when it is done (the host waits on that
               event, and only when it handles the step)
    to_device  (chapter 08) a host list as a device tensor: through pinned memory, non-blocking;
               from chapter 15 several lists in one copy (to_device_together)
"""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying t to the host; on a GPU the copy runs behind the step and records an event. On a
    CPU t is on the host already and there is nothing to wait for."""
    if t.device.type != "cuda":
        return t, None
    cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    cpu.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return cpu, done
# >>> ch08: never block on the schedule stream


def to_device(values: list[int], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A host list as a device tensor, without making the host wait: on a GPU through pinned memory with a
    non-blocking copy. (A blocking copy from pageable memory makes the host wait for the current stream,
    and behind the fence the schedule stream may be waiting for a whole step.)"""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t
# <<< ch08
# >>> ch15: several lists in one copy


def to_device_together(lists: dict[str, list[int]], dtype: torch.dtype,
                       device: str | torch.device) -> dict[str, torch.Tensor]:
    """Host lists as device tensors, by name, through one pinned buffer and one copy: each tensor a view
    of the one copied (a step's index lists: one transfer a step, not one a list)."""
    flat = to_device([v for values in lists.values() for v in values], dtype, device)
    return dict(zip(lists, flat.split([len(values) for values in lists.values()])))
# <<< ch15
