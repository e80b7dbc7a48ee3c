"""The torch back end's devices: the host device, eager mode and CUDA allocator statistics."""

from __future__ import annotations

import torch

from keras_lms.offload.common import single_host_device


def executing_eagerly() -> bool:
    return True


def validate_host_device(host_device: str) -> str:
    """Resolve ``host_device`` to the host ('/CPU:0'); torch has one CPU device."""
    return single_host_device(host_device, "gpu|cuda|tpu|mps|xla", "on this machine")


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
