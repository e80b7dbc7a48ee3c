"""The JAX back end's planning trace (Keras' shape inference, ``jax.eval_shape``): input signatures, placeholder
specs and traced calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common


def _keras_dtype(dtype) -> str:
    return keras.backend.standardize_dtype(dtype)


def _is_tensor(value) -> bool:
    # jax.Array covers tracers too (jit, grad, eval_shape); numpy arrays are what an eager call may pass
    return isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.generic)


# How this back end reads a tensor (the recorder of the planning trace and the step context use it).
TENSOR_FACTS = common.TensorFacts(
    is_tensor=_is_tensor,
    shape=lambda t: list(t.shape),
    dtype=lambda t: _keras_dtype(t.dtype),
    rank=lambda t: len(t.shape),
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
    """Run ``model(inputs, training=True)`` symbolically and list its unit calls in order.

    Keras' JAX shape inference runs the call under ``jax.eval_shape``: only shapes are recorded, nothing is
    computed and no state changes (it runs under a StatelessScope); losses added during the trace are cleared.
    It runs inside the trainer's own trace of the step when a new input signature arrives.
    """
    recorder = common.CallRecorder(structure, TENSOR_FACTS, foreign_reads=common.foreign_variable_reads)
    spec_inputs, spec_kwargs = keras.tree.map_structure(_spec, (inputs, kwargs))

    def forward(x, kw):
        recorder.clear()  # Keras traces twice when a dimension is unknown
        # Keras' JAX `fit` purges the variables' values while its jitted loop holds the state, and shape
        # inference opens a scope of its own without that state: give every variable a stand-in of its shape
        # (made inside jax.eval_shape, so abstract: nothing is allocated).
        stand_ins = [(v, jnp.zeros(v.shape, v.dtype)) for v in model.variables]
        with keras.StatelessScope(state_mapping=stand_ins):
            return model(x, training=True, **kw)

    with adapter.patched_calls(structure.units, recorder.make_wrapper):
        adapter.compute_output_spec(forward, spec_inputs, spec_kwargs)
    adapter.clear_losses(model)
    return recorder.calls


def example_inputs(model, batch_size: int):
    """Placeholder specs for a built model's inputs, or None when the model does not say its input shape."""
    return common.example_inputs(model, batch_size, spec_for)
