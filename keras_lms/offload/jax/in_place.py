"""Element-wise forwards written in place of their input, a window of rows at a time (JAX back end).

In the 3D U-Net a convolution's output, the BatchNormalization after it and the ReLU after that are three
full-size tensors in a row. In the program XLA compiles for a GPU the middle one overlaps both neighbours for one
instruction each while the neighbours never overlap, and XLA's greedy best-fit heap (no option to change it)
places them at three different offsets: at the 480^3 float32 cube three 6.59 GiB buffers where two suffice
(docs/jax_findings.md, sessions 20 and 21). Computed in place, the three are one buffer.

A call here is the layer's own ``call`` on a window of rows at a time (``row_windows.over_rows`` with
``overwrite``): each window's output is written into the input's buffer once the previous window is written.
The input's host copy, what the backward reads, is made before (``host_residuals`` orders a ``forward_call``
after the copies to host). Element-wise layers (ReLU and Keras' other element-wise activations) give each element
exactly the value of the whole call; BatchNormalization in training normalises each window with the statistics of
the whole input (Keras' own ``ops.moments`` on it, handed to each window's call through ``given_moments``), so
its outputs and moving statistics are the whole call's as well: the same operations on the same elements.

Where the input has another reader after this call, XLA keeps the program correct by copying it first (a
functional program has no aliasing), so an in-place call never changes a value, only, at worst, the memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras

from keras_lms import _keras_adapter as adapter
from keras_lms.offload.common import given_moments
from keras_lms.offload.jax import lean_norm, row_windows
from keras_lms.planning import layer_facts

__all__ = ["IN_PLACE", "in_place_call", "in_place_windows", "relu_pullback"]

IN_PLACE = True  # False: element-wise forwards run whole (the control of the compiled-program tests)
_ACTIVATIONS = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU, keras.layers.Activation)


def _normalization(layer, arrays, kwargs) -> bool:
    """Keras' own BatchNormalization in training with batch statistics over the last axis (the lean backward's
    case), whose statistics can be handed to its call (``_keras_adapter.batchnorm_moments_hook``)."""
    return (lean_norm.eligible_call(layer, arrays, kwargs) and adapter.batchnorm_moments_hook(layer) is not None
            and layer.axis % arrays[0].ndim == arrays[0].ndim - 1)


def _elementwise(layer, arrays, kwargs) -> bool:
    """A layer whose call maps each element alone (``layer_facts.slab_halo`` 0: ReLU, LeakyReLU, ELU, an
    ``Activation`` of one of Keras' element-wise functions), called without keyword arguments."""
    return type(layer) in _ACTIVATIONS and not kwargs and layer_facts.slab_halo(layer, arrays[0].ndim) == 0


def in_place_windows(layer, arrays, kwargs, slab_bytes: int) -> int:
    """How many windows of rows ``layer``'s call on ``arrays`` runs in place in (its input's bytes over
    ``slab_bytes``); 1: whole, as Keras runs it (a small input, a layer not handled here, ``IN_PLACE`` off)."""
    if not (IN_PLACE and slab_bytes and len(arrays) == 1 and getattr(arrays[0], "ndim", 0) >= 3):
        return 1
    if not (_normalization(layer, arrays, kwargs) or _elementwise(layer, arrays, kwargs)):
        return 1
    x = arrays[0]
    return row_windows.window_count(row_windows.nbytes(x), x.shape[1], slab_bytes)


def in_place_call(layer, original, windows: int):
    """``original`` (the layer's own ``call``) a window of rows at a time, written in place of its input (module
    docstring): a ``forward_call`` for ``host_residuals.host_residual_call``."""
    normalization = type(layer) is keras.layers.BatchNormalization

    def call(inputs, **kwargs):
        if normalization:
            # the whole input's statistics, as Keras' ``_moments`` computes them (in the compute dtype)
            compute = keras.backend.result_type(inputs.dtype, "float32")
            axes = adapter.batchnorm_reduction_axes(layer, inputs)
            moments = keras.ops.moments(keras.ops.cast(inputs, compute), axes=axes)
        # the dtype the layer's own call returns (Keras' tanh of a float64 input is float32, for one)
        spec = jax.ShapeDtypeStruct((inputs.shape[0], 1, *inputs.shape[2:]), inputs.dtype)
        dtype = (keras.backend.standardize_dtype(layer.compute_dtype) if normalization
                 else jax.eval_shape(lambda rows: original(rows, **kwargs), spec).dtype)
        # each window's call updates the moving statistics from the values before the call, as the whole call
        # does (once): every window's update is the same, and the state after is one of them
        state = list(layer.non_trainable_variables)
        before, after = [v.value for v in state], []

        def window(rows):
            if not normalization:
                outputs = original(rows, **kwargs)
            else:
                with given_moments(layer, lambda _: moments):
                    outputs = original(rows, **kwargs)
            after[:] = [v.value for v in state]
            for variable, value in zip(state, before):
                variable.assign(value)
            return (), outputs

        same = keras.backend.standardize_dtype(inputs.dtype) == dtype
        _, outputs = row_windows.over_rows(window, [inputs], [1], inputs.shape[1], windows, 1,
                                           out=(tuple(inputs.shape), dtype, 1), overwrite=[0 if same else None])
        for variable, value in zip(state, after):
            variable.assign(value)
        return outputs

    return call


def relu_pullback(layer, arrays, kwargs, slab_bytes: int):
    """A ``pullback_maker`` for a plain ReLU's call on an input of more than ``slab_bytes``, else None: it keeps
    the mask ``x > 0`` (one byte per element, in host memory) and writes the input gradient ``where(mask, dy, 0)``
    (JAX's own ReLU derivative) into the output gradient's buffer a window of rows at a time, reading the mask's
    rows from host as it goes. JAX's pullback made it a new full-size buffer beside the output gradient: with
    BatchNormalization's gradient after it, the 3D U-Net's first-level backward held two full-size float32
    gradients (docs/jax_findings.md)."""
    if layer_facts.standalone_activation(layer) != "relu":
        return None
    windows = in_place_windows(layer, arrays, kwargs, slab_bytes)
    if windows <= 1:
        return None

    def make(trainable, arrays):
        return jax.tree_util.Partial(functools.partial(_relu_grads, windows), arrays[0] > 0)

    make.streams_host_rows = True  # the mask read a window of rows at a time (host_residuals)
    return make


def _relu_grads(windows: int, mask, cotangent):
    """([], [input gradient]) of a ReLU from its mask, written over ``cotangent`` a window of rows at a time."""
    def window(masks, cotangents):
        return (), jnp.where(masks, cotangents, jnp.zeros_like(cotangents))

    _, grad = row_windows.over_rows(window, [mask, cotangent], [1, 1], mask.shape[1], windows, 1,
                                    out=(tuple(cotangent.shape), cotangent.dtype, 1), overwrite=[1])
    return [], [grad]
