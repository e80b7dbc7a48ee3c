"""The TensorFlow back end's devices: the host device, device scopes, eager mode and allocator statistics."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_lms.offload.common import DeviceStatsUnavailable


def executing_eagerly() -> bool:
    return tf.executing_eagerly()


def on_device(device):
    """``tf.device(device)``, or no scope when the forward ops carried no device of their own.

    Unplaced forward ops run where the placer puts the step (the GPU, or the device the user's ``tf.device``
    scope or Horovod's pinning names); the backward ops must then stay unplaced too, so they land on the same
    device. Naming a default here would be wrong whenever it is not that device (e.g. a second CPU device).
    """
    return tf.device(device) if device else contextlib.nullcontext()


def validate_host_device(host_device: str) -> str:
    """Resolve ``host_device`` to a CPU device that exists, or say which ones do."""
    try:
        spec = tf.DeviceSpec.from_string(host_device)
    except ValueError as err:
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.") from err
    if (spec.device_type or "").upper() != "CPU":
        raise ValueError(
            f"host_device={host_device!r} is not a CPU device. keras-lms offloads activations to host memory; "
            "use '/CPU:0'."
        )
    index = spec.device_index or 0
    cpus = tf.config.list_logical_devices("CPU")
    if index >= len(cpus):
        names = ", ".join(d.name for d in cpus)
        raise ValueError(f"host_device={host_device!r} does not exist on this machine; available: {names}.")
    return f"/CPU:{index}"


# ------------------------------------------------------------------------------------------ memory readings
def default_device() -> str:
    """The device whose memory matters: the first GPU when there is one, else the CPU allocator."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _no_stats(device: str) -> DeviceStatsUnavailable:
    """TensorFlow's default CPU allocator keeps no statistics on machines without NUMA; its BFC allocator does."""
    hint = (" On CPU, set the environment variable TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported."
            if device.upper().startswith("CPU") else "")
    return DeviceStatsUnavailable(f"TensorFlow keeps no allocator statistics for {device}", hint)


def reset_device_peak(device: str) -> None:
    """Restart the allocator peak of ``device``; DeviceStatsUnavailable when it keeps no statistics."""
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as err:
        raise _no_stats(device) from err


def device_peak_bytes(device: str) -> int | None:
    """Peak bytes allocated on ``device`` since the last reset; DeviceStatsUnavailable when TensorFlow keeps none."""
    try:
        return int(tf.config.experimental.get_memory_info(device)["peak"])
    except (ValueError, RuntimeError) as err:
        raise _no_stats(device) from err
