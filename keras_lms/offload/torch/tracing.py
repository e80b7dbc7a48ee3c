"""The torch back end's planning trace on "meta" tensors: input signatures, placeholder specs, traced calls."""

from __future__ import annotations

import keras
import torch

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common


def _keras_dtype(dtype) -> str:
    return keras.backend.standardize_dtype(dtype)


# How this back end reads a tensor (the recorder of the planning trace and the step context use it).
TENSOR_FACTS = common.TensorFacts(
    is_tensor=lambda value: isinstance(value, torch.Tensor),
    shape=lambda t: list(t.shape),
    dtype=lambda t: _keras_dtype(t.dtype),
    rank=lambda t: t.dim(),
)


def _spec(value):
    return common.spec_of(value, TENSOR_FACTS)


def spec_for(shape, dtype):
    """A placeholder spec for trace_calls from a shape (with batch axis) and dtype."""
    return keras.KerasTensor(tuple(shape), dtype)


def signature_of(inputs, kwargs):
    """Hashable key of a call's tensor shapes/dtypes: one plan per input signature."""
    return common.signature_of(inputs, kwargs, TENSOR_FACTS)


def trace_calls(model, structure, inputs, kwargs) -> list:
    """Run ``model(inputs, training=True)`` symbolically (torch "meta" tensors) and list its unit calls in order.

    Only shapes are recorded; nothing is computed on the device and no state changes (Keras' symbolic call
    runs under a StatelessScope); losses added during the trace are cleared.
    """
    recorder = common.CallRecorder(structure, TENSOR_FACTS, foreign_reads=common.foreign_trainable_reads)
    spec_inputs, spec_kwargs = keras.tree.map_structure(_spec, (inputs, kwargs))

    def forward(x, kw):
        recorder.clear()  # Keras retries on real tensors when an op has no meta kernel
        return model(x, training=True, **kw)

    with adapter.patched_calls(structure.units, recorder.make_wrapper):
        adapter.compute_output_spec(forward, spec_inputs, spec_kwargs)
    adapter.clear_losses(model)
    return recorder.calls


def example_inputs(model, batch_size: int):
    """Placeholder specs for a built model's inputs, or None when the model does not say its input shape."""
    return common.example_inputs(model, batch_size, spec_for)
