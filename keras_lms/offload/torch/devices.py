"""The torch back end's devices: the host device, eager mode and CUDA allocator statistics."""

from __future__ import annotations

import re

import torch


def executing_eagerly() -> bool:
    return True


_HOST_RE = re.compile(r"^/?(?:device:)?(cpu)(?::(\d+))?$", re.IGNORECASE)


def validate_host_device(host_device: str) -> str:
    """Resolve ``host_device`` to the host ('/CPU:0'); torch has one CPU device."""
    if not isinstance(host_device, str):
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    match = _HOST_RE.match(host_device.strip())
    if match is None:
        if re.match(r"^/?(?:device:)?(gpu|cuda|tpu|mps|xla)", host_device.strip(), re.IGNORECASE):
            raise ValueError(
                f"host_device={host_device!r} is not a CPU device. keras-lms offloads activations to host memory; "
                "use '/CPU:0'."
            )
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    index = int(match.group(2) or 0)
    if index != 0:
        raise ValueError(f"host_device={host_device!r} does not exist on this machine; available: /CPU:0.")
    return "/CPU:0"


# ------------------------------------------------------------------------------------------ memory readings
def default_device() -> str:
    """The device whose memory matters: the first GPU when there is one, else the CPU."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def reset_device_peak(device: str) -> None:
    """Restart the CUDA allocator's peak of ``device`` (nothing to reset on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_bytes(device: str) -> int | None:
    """Peak bytes allocated on a CUDA ``device`` since the last reset; None on the CPU (torch keeps no count)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return None
