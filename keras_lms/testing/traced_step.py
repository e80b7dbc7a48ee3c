"""One Keras training step as a GraphDef on the virtual machine's devices, every variable's shape known.

``trace_training_step`` builds the step (forward, loss, ``tape.gradient``, optimizer update) under
``tf.device(STAND_IN)``; nothing is executed. ``to_virtual_devices`` then maps the GraphDef onto the virtual
machine (keras_lms/testing/virtual_cluster.py): ``/CPU:1`` and unplaced nodes go to ``GPU:0``, ``/CPU:0`` nodes
stay on the host CPU. Captured variables arrive as resource placeholders that carry no shape, so
``resolve_variable_shapes`` turns each into a ``VarHandleOp`` with the variable's shape and dtype: shape
inference then knows every weight, hence every activation.
"""

from __future__ import annotations

import dataclasses

from keras_lms.testing.conv_flops import traced_convolution_shapes
from keras_lms.testing.logical_devices import STAND_IN
from keras_lms.testing.virtual_cluster import GPU, HOST


@dataclasses.dataclass
class TracedStep:
    """One training step as a GraphDef, the nodes to fetch, and the bytes of the variables it updates."""

    graph_def: object
    fetch: list
    static_bytes: int
    # convolution op name -> (input shapes, output shapes) as traced: a fallback where grappler's shape
    # inference of the optimised graph loses them (conv_flops)
    convolution_shapes: dict = dataclasses.field(default_factory=dict)


def _variable_bytes(variables) -> int:
    import numpy as np

    return sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in variables)


def trace_training_step(model, x_shape, y_shape, dtype="float32", optimizer="adam") -> TracedStep:
    """Trace loss = mean((model(x, training=True) - y)^2), its gradients and (optionally) their update.

    ``optimizer``: "adam" (default; two slots per weight, as ``keras_lms.report`` assumes), "sgd", or None to
    return the gradients instead (they then live until the step ends). An update makes the gradients live
    until they are applied, as in ``fit``. Inputs are function arguments (placeholders), not constants, so
    a large batch costs nothing to trace; they are pinned to the stand-in device first because keras-lms
    places a layer's backward on its input's device.
    """
    import keras
    import tensorflow as tf

    variables = model.trainable_variables
    opt = None
    if optimizer is not None:
        with tf.device(STAND_IN):
            opt = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}[optimizer](1e-3)
            opt.build(variables)

    @tf.function(jit_compile=False, autograph=False)
    def step(x, y):
        with tf.device(STAND_IN):
            x, y = tf.identity(x), tf.identity(y)
            with tf.GradientTape() as tape:
                # Under mixed precision the model returns float16: the loss is computed in float32, as Keras does.
                loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), y.dtype) - y))
            grads = tape.gradient(loss, variables)
            if opt is None:
                return loss, grads
            opt.apply(grads, variables)
        return loss

    concrete = step.get_concrete_function(tf.TensorSpec(x_shape, dtype), tf.TensorSpec(y_shape, dtype))
    func_graph = concrete.graph
    graph_def = func_graph.as_graph_def()
    resolve_variable_shapes(graph_def, func_graph)
    to_virtual_devices(graph_def)
    fetch = [t.op.name for t in func_graph.outputs] + [op.name for op in func_graph.control_outputs]
    static = _variable_bytes(model.variables) + (_variable_bytes(opt.variables) if opt is not None else 0)
    return TracedStep(graph_def, list(dict.fromkeys(fetch)), static, traced_convolution_shapes(func_graph))


def resolve_variable_shapes(graph_def, func_graph) -> int:
    """Turn each captured variable's resource placeholder into a ``VarHandleOp`` of its shape and dtype.

    A captured handle reaches the GraphDef as ``Placeholder(dtype=resource)`` without shape: shape inference
    then cannot know a weight's shape, a convolution's output shape becomes unknown and its memory reads as
    (almost) nothing. The handle's shape travels only in Python-side handle data, which is read here.
    Returns the number of placeholders rewritten.
    """
    import tensorflow as tf
    from tensorflow.python.ops import handle_data_util

    shapes = {}
    for _, internal in func_graph.captures:
        if internal.dtype != tf.resource:
            continue
        data = handle_data_util.get_resource_handle_data(internal)
        if data.is_set and data.shape_and_type:
            shapes[internal.op.name] = data.shape_and_type[0]
    for node in graph_def.node:
        entry = shapes.get(node.name)
        if entry is None or node.op != "Placeholder":
            continue
        node.op = "VarHandleOp"
        node.ClearField("attr")
        node.attr["dtype"].type = entry.dtype
        node.attr["shape"].shape.CopyFrom(entry.shape)
        node.attr["shared_name"].s = node.name.encode()
        node.attr["container"].s = b""
    return len(shapes)


def virtual_device(device: str) -> str:
    """The virtual machine's device for a traced node: the host stays on the CPU, everything else is GPU."""
    import tensorflow as tf

    if not device:
        return GPU
    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type or "").upper() == "CPU" and (spec.device_index or 0) == 0:
        return HOST
    return GPU


def to_virtual_devices(graph_def) -> None:
    """Place every node (and every node of library functions) on the virtual GPU or the host, in place."""
    for node in graph_def.node:
        node.device = virtual_device(node.device)
    for function in graph_def.library.function:
        for node in function.node_def:
            node.device = virtual_device(node.device)
