"""The JAX back end's devices: the host device, eager mode and XLA's allocator statistics."""

from __future__ import annotations

import jax

from keras_lms.offload.common import DeviceStatsUnavailable, single_host_device


def executing_eagerly() -> bool:
    """False: Keras' JAX trainer differentiates the step with ``jax.value_and_grad``, which always traces the
    forward pass (also with ``run_eagerly=True``), so every offloaded call is a traced ``custom_vjp``."""
    return False


def validate_host_device(host_device: str) -> str:
    """Resolve ``host_device`` to the host ('/CPU:0'): JAX places a host copy in the compute device's own host
    memory space (``jax.memory.Space.Host``, pinned host memory on a GPU), not on a device of its choosing."""
    return single_host_device(host_device, "gpu|cuda|rocm|tpu|xla",
                              "for JAX: a host copy lives in the compute device's own host memory space")


# ------------------------------------------------------------------------------------------ memory readings
def _device(name: str):
    for device in jax.devices():
        if f"{device.platform}:{device.id}" == name:
            return device
    names = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())
    raise ValueError(f"device={name!r} is not a JAX device of this process; available: {names}.")


def default_device() -> str:
    """The device whose memory matters: JAX's first device (a GPU when there is one), as ``platform:id``."""
    device = jax.devices()[0]
    return f"{device.platform}:{device.id}"


def _stats(name: str) -> dict:
    stats = _device(name).memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        raise DeviceStatsUnavailable(
            f"JAX keeps no allocator statistics for {name}",
            " XLA's CPU client has none; on a GPU they are there." if name.startswith("cpu") else "")
    return stats


def reset_device_peak(device: str) -> None:
    """XLA's allocator cannot restart its peak: its ``peak_bytes_in_use`` counts from the process start, so a
    high-water mark read on the JAX back end is the process's (it never falls). Checks the statistics exist."""
    _stats(device)


def device_peak_bytes(device: str) -> int | None:
    """Peak bytes XLA's allocator held on ``device`` since the process started (``memory_stats()``)."""
    return int(_stats(device)["peak_bytes_in_use"])
