"""A lean backward for an offloaded BatchNormalization with batch statistics (JAX back end).

Keras computes BatchNormalization in float32 even for float16/bfloat16 inputs. ``jax.vjp`` of its call keeps
float32 input-sized residuals (the centred input), so under mixed precision the call sends twice its input's bytes
to host and brings them back. At the 3D U-Net's mixed_float16 cube (448^3) that was the compiled step's peak:
`down0_bn1`'s backward held a float32 residual (5.36 GiB) beside a float32 channels-first temporary and the
float16 input and gradient (docs/jax_findings.md).

Here the forward pass is Keras' own (outputs, moving statistics), and the pullback keeps only the input, in its
own dtype, and the scale. The backward recomputes the batch mean and variance from the input as Keras computes
them (``keras.ops.moments``, in float32 for 16-bit inputs) and evaluates the batch-norm gradient
(``xhat = (x - mean) * rsqrt(variance + epsilon)``, ``N`` the elements per channel):

    d_offset = sum(dy)      d_scale = sum(dy * xhat)      dx = scale * rsqrt(variance + epsilon) *
                                                               (dy - d_offset / N - xhat * d_scale / N)

which is what differentiating Keras' function gives, through the statistics too, up to float rounding; XLA fuses
the float32 arithmetic into the backward's reductions and its one elementwise pass.

Only for Keras' own BatchNormalization in training with batch statistics (trainable, no renorm, not
synchronised, no mask), and for inputs whose dtype Keras computes in (float32, float16, bfloat16): Keras computes
a float64 model's BatchNormalization in float32 on JAX, and only JAX's own differentiation reproduces that
rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import keras

from keras_lms.offload.jax import row_windows

__all__ = ["eligible_call", "lean_batchnorm_pullback", "lean_layer", "normalization_windows"]

OVERWRITE = True  # False: the windowed input gradient gets a buffer of its own (the compiled tests' control)


def lean_layer(layer, dtype) -> bool:
    """Keras' own BatchNormalization, no renorm, not synchronised, on inputs of ``dtype`` that Keras computes in
    (a float of at most 32 bits): what the lean backward needs of the layer, whatever the call (also what the
    planner's ``JaxFacts.host_bytes`` counts such a call's host copy by)."""
    return (type(layer) is keras.layers.BatchNormalization and not layer.renorm and not layer.synchronized
            and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize <= 4)


def eligible_call(layer, arrays, kwargs) -> bool:
    """``lean_layer``, called in training with batch statistics (trainable), on one unmasked input."""
    if len(arrays) != 1 or not lean_layer(layer, arrays[0].dtype):
        return False
    return (kwargs.get("training") is True and layer.trainable and kwargs.get("mask") is None
            and arrays[0].ndim >= 2)


def _grads(spec, x, scale, cotangent):
    """(trainable gradients in ``spec``'s order, [input gradient]), over windows of rows (`row_windows`) when
    ``spec`` has more than one: each pass's float32 temporaries are a window's. ``x`` is stored channels-first
    where ``spec``'s ``first`` says so (`stored_channels_first`)."""
    axes, epsilon, scale_index, offset_index, count, dtypes, first, windows = spec
    shape = (x.shape[0], *x.shape[2:], x.shape[1]) if first else tuple(x.shape)
    n = math.prod(shape[a] for a in axes)
    axis = row_windows.row_axis(len(shape), [a for a in range(len(shape)) if a not in axes])
    rows = shape[axis] if axis is not None else 1
    keep = dict(axis=axes, keepdims=True)
    x_axis = [2 if first else axis]

    def f32(t):
        return t.astype(jnp.float32)

    def f32_x(t):  # a window of x, channels-last, in float32
        return f32(jnp.moveaxis(t, 1, -1) if first else t)

    # the statistics as Keras computes them (``keras.ops.moments``: the mean, then the mean squared deviation)
    (total,), _ = row_windows.over_rows(lambda xs: ((jnp.sum(f32_x(xs), **keep),), None), [x], [1], rows, windows,
                                        axis, axes=x_axis)
    mean = total / n

    def deviation_sums(xs, dys):
        centred, dy = f32_x(xs) - mean, f32(dys)
        return (jnp.sum(centred * centred, **keep), jnp.sum(dy, **keep), jnp.sum(dy * centred, **keep)), None

    (squares, d_offset, d_centred), _ = row_windows.over_rows(deviation_sums, [x, cotangent], [1, 1], rows,
                                                              windows, axis, axes=x_axis + [axis])
    inv = jax.lax.rsqrt(squares / n + epsilon)
    d_scale = d_centred * inv
    g = inv if scale is None else inv * scale.astype(jnp.float32).reshape(mean.shape)

    def input_rows(xs, dys):
        xhat = (f32_x(xs) - mean) * inv
        return (), g * (f32(dys) - d_offset / n - xhat * (d_scale / n))

    # dx rows read only the same rows of dy: written in place of dy where it has dx's shape and dtype
    same = OVERWRITE and tuple(cotangent.shape) == tuple(shape) and cotangent.dtype == x.dtype
    _, dx = row_windows.over_rows(input_rows, [x, cotangent], [1, 1], rows, windows, axis,
                                  out=(shape, x.dtype, 1), axes=x_axis + [axis], overwrite=[1 if same else None])
    grads = [None] * count
    if scale_index is not None:
        grads[scale_index] = d_scale.reshape(-1).astype(dtypes[scale_index])
    if offset_index is not None:
        grads[offset_index] = d_offset.reshape(-1).astype(dtypes[offset_index])
    return grads, [dx.astype(x.dtype)]


def stored_channels_first(layer, x) -> bool:
    """An input XLA holds channels-first (``row_windows.held_channels_first``) normalised over its last axis is
    stored channels-first, its host copy too: the channels-last copy was a transposed full-size temporary (5.36 GiB
    at the 3D U-Net's 448^3 float32 cube, beside the windowed convolution's output and the bias-added one: the
    forward's peak)."""
    return row_windows.held_channels_first(x) and layer.axis % 5 == 4


def normalization_windows(layer, x, slab_bytes: int) -> int:
    """How many windows of rows the lean backward of ``layer`` on input ``x`` runs in: its bytes over
    ``slab_bytes``, along the first axis after the batch's that is not the channels' (1: none such)."""
    axis = row_windows.row_axis(x.ndim, [layer.axis])
    return row_windows.window_count(row_windows.nbytes(x), x.shape[axis], slab_bytes) if axis is not None else 1


def lean_batchnorm_pullback(layer, trainable, arrays, kwargs, slab_bytes: int = 0):
    """A ``pullback_maker(trainable, arrays)`` for an eligible BatchNormalization call (module docstring), else
    None; the maker returns a ``jax.tree_util.Partial`` whose leaves are the residuals (the input, the scale).
    An input larger than ``slab_bytes`` (``LMSConfig.slab_bytes``; 0: never) is differentiated in windows of
    rows."""
    if not eligible_call(layer, arrays, kwargs):
        return None
    variables = list(layer.trainable_variables)
    scale_index = next((i for i, v in enumerate(variables) if layer.scale and v is layer.gamma), None)
    offset_index = next((i for i, v in enumerate(variables) if layer.center and v is layer.beta), None)
    if len(variables) != (scale_index is not None) + (offset_index is not None):
        return None
    ndim = arrays[0].ndim
    axes = tuple(i for i in range(ndim) if i != layer.axis % ndim)
    spec = (axes, float(layer.epsilon), scale_index, offset_index, len(variables),
            [jnp.dtype(v.dtype) for v in variables], stored_channels_first(layer, arrays[0]),
            normalization_windows(layer, arrays[0], slab_bytes))

    def make(trainable, arrays):
        scale = trainable[scale_index] if scale_index is not None else None
        x = jnp.moveaxis(arrays[0], -1, 1) if spec[-2] else arrays[0]
        return jax.tree_util.Partial(functools.partial(_grads, spec), x, scale)

    make.streams_host_rows = spec[-1] > 1  # the input read a window of rows at a time (host_residuals)
    return make
