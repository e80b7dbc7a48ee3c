"""The TensorFlow back end's planning trace: input signatures, placeholder specs, and the traced unit calls."""

from __future__ import annotations

import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common


def _shape(t):
    return t.shape.as_list() if t.shape.rank is not None else []


# How this back end reads a tensor (the recorder of the planning trace and the step context use it).
TENSOR_FACTS = common.TensorFacts(
    is_tensor=lambda value: isinstance(value, tf.Tensor),
    shape=_shape,
    dtype=lambda t: t.dtype.name,
    rank=lambda t: t.shape.rank or 0,
    flatten=tf.nest.flatten,
)


def _spec(value):
    if isinstance(value, tf.Tensor):
        return tf.TensorSpec(value.shape, value.dtype)
    return value


def signature_of(inputs, kwargs):
    """Hashable key of a call's tensor shapes/dtypes: one plan per traced input signature."""
    leaves = tf.nest.flatten((inputs, kwargs))
    return tuple(
        (tuple(leaf.shape.as_list()) if leaf.shape.rank is not None else None, leaf.dtype.name)
        if isinstance(leaf, tf.Tensor) else repr(leaf)
        for leaf in leaves
    )


def trace_calls(model, structure, inputs, kwargs) -> list:
    """Trace ``model(inputs, training=True)`` in a throw-away graph and list its unit calls in order.

    Only shapes are recorded; the trace runs nothing and leaves no state behind (losses added during the
    trace are cleared).
    """
    recorder = common.CallRecorder(structure, TENSOR_FACTS)
    specs = tf.nest.map_structure(_spec, (inputs, kwargs))

    def forward(spec_inputs, spec_kwargs):
        return model(spec_inputs, training=True, **spec_kwargs)

    with adapter.patched_calls(structure.units, recorder.make_wrapper):
        tf.function(forward, autograph=False).get_concrete_function(*specs)
    adapter.clear_losses(model)
    return recorder.calls


def spec_for(shape, dtype):
    """A placeholder spec for trace_calls from a shape (with batch axis) and dtype."""
    return tf.TensorSpec(shape, dtype)


def example_inputs(model, batch_size: int):
    """Placeholder specs for a built model's inputs, or None when the model does not say its input shape."""
    return common.example_inputs(model, batch_size, spec_for, tf.nest.map_structure)

