"""Two logical CPU devices: ``/CPU:0`` the host, ``/CPU:1`` a stand-in for the accelerator.

A CPU-only TensorFlow has one device, so a host copy and the tensor it copies would live in the same place and
no cross-device transfer would appear in the graph. Splitting the CPU in two gives the graph a device boundary
where a GPU would put one: the GPU simulation (`keras_lms.testing.simulated_gpu`) traces the step on the
stand-in and maps it to a virtual GPU; the executed-graph tests (tests/offload/tensorflow/executed_graph.py) run
it there.
"""

from __future__ import annotations

STAND_IN = "/CPU:1"  # where the model, its variables and the step are traced; becomes GPU
HOST_STAND_IN = "/CPU:0"  # host placement in the traced graph; stays on the host CPU


def configure_logical_cpus() -> None:
    """Split the physical CPU into /CPU:0 (host) and /CPU:1 (GPU stand-in). Call before TensorFlow starts."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is not None and len(existing) >= 2:
        return
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
