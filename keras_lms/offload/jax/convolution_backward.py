"""The backward of a large convolution in windows of rows (JAX back end).

A convolution whose forward runs in windows (``convolutions``: stride 1, "same", odd kernels, a linear
activation, inputs larger than ``slab_bytes``) had its backward whole: in the program XLA compiles for a GPU its
inputs (brought back from host), its output gradient and a channels-first copy of an input, each full-size. At
the 3D U-Net's 416^3 float32 cube that was the decoder's first convolution (both of its concatenation's parts,
4.29 GiB each, the output gradient and a transposed part: 17.77 GiB). Here the backward runs in two passes over
windows of rows (``row_windows.over_rows``), each window cut only once the previous one is done:

* the kernel (and bias) gradient: a sum over windows of the kernel-transpose of the window's convolution, read
  from the input rows widened by the kernel's halo and the window's output-gradient rows;
* then the input gradient, written window by window: input rows ``a..b`` read the output-gradient rows widened
  by the halo (the transpose of the window's convolution in its input).

So the inputs are last read by the first pass, and only one window's layout copies exist at a time. The gradients
equal JAX's up to the order of float additions (float64: 1e-12, tests/offload/jax/test_convolutions.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras

from keras_lms.offload.jax import convolutions, row_windows
from keras_lms.offload.jax.lean import kernel_and_bias

__all__ = ["OVERWRITE", "WINDOWED", "windowed_pullback"]

WINDOWED = True  # False: the windowed forward's backward runs whole (the control of the compiled-program tests)
OVERWRITE = True  # False: the input gradients get buffers of their own (the control)


def windowed_pullback(layer, count: int, windows: int):
    """A ``pullback_maker(trainable, arrays)`` for a windowed convolution call over ``count`` input parts (the
    channels its kernel's input axis concatenates), or None when its variables are not a kernel and a bias."""
    indices = kernel_and_bias(layer)
    if not WINDOWED or indices is None or windows < 2:
        return None
    kernel_index, bias_index = indices
    halos = tuple(convolutions.halos(layer))
    spec = (halos, tuple(layer.dilation_rate), kernel_index, bias_index, len(layer.trainable_variables), count,
            windows)

    def make(trainable, arrays):
        bias = trainable[bias_index] if bias_index is not None else jnp.zeros((), trainable[kernel_index].dtype)
        # a part parked in host memory (``step``) stays as it is: its gradient is assembled there too
        parked = tuple(row_windows.on_host(x) for x in arrays)
        first = tuple(row_windows.held_channels_first(x) for x in arrays)  # (a parked part is on host: never)
        stored = [_channels_first(x) if f else x for x, f in zip(arrays, first)]
        return jax.tree_util.Partial(functools.partial(_grads, spec, (first, parked)), stored,
                                     trainable[kernel_index], bias)

    make.streams_host_rows = True  # its inputs are read a window of rows at a time (host_residuals)
    return make


def _channels_first(x):
    return jnp.moveaxis(x, -1, 1)


def _channels_last(x, first: bool):
    """The inverse of `_channels_first` for an array (or a window of its rows) stored channels-first (``first``)."""
    return jnp.moveaxis(x, 1, -1) if first else x


def _channels_last_shape(x, first: bool) -> tuple:
    """The shape the input stored as ``x`` had (``first``: stored channels-first)."""
    shape = tuple(x.shape)
    return (shape[0], *shape[2:], shape[1]) if first else shape


def _grads(spec, layout, stored, kernel, bias, cotangent):
    """(trainable gradients in ``spec``'s order, [input gradients]) of the convolution summed over its inputs
    (``stored`` as `_channels_first` stored them where ``layout``'s ``first`` says so; in host memory, streamed:
    only a window's rows are brought back at a time, ``row_windows.over_rows``). The gradient of a part given in
    host memory (``parked``, ``parking``) is assembled there."""
    first, parked = layout
    halos, dilation, kernel_index, bias_index, count, parts, windows = spec
    shapes = [_channels_last_shape(x, f) for x, f in zip(stored, first)]
    compute = cotangent.dtype
    total = jnp.promote_types(compute, jnp.float32)
    kernels, start = [], 0
    for shape in shapes:
        kernels.append(kernel.astype(compute)[..., start:start + shape[-1], :])
        start += shape[-1]
    across = [(h, h) for h in halos[1:]]  # "same" padding of the other spatial axes
    rows, h = shapes[0][1], halos[0]

    def convolve(x, k):
        return keras.ops.conv(x, k, strides=1, padding="valid", dilation_rate=dilation, data_format="channels_last")

    def weight_window(*slices):
        *xs, dy = slices
        d_kernels = []
        for x, k, f in zip(xs, kernels, first):
            padded = jnp.pad(_channels_last(x, f), [(0, 0), (0, 0), *across, (0, 0)])
            (d_k,) = jax.linear_transpose(lambda kk, padded=padded: convolve(padded, kk), k)(dy)
            d_kernels.append(d_k.astype(total))
        return (d_kernels, jnp.sum(dy, axis=tuple(range(dy.ndim - 1))).astype(total)), None

    axes = [2 if f else 1 for f in first] + [1]
    (d_kernels, d_bias), _ = row_windows.over_rows(weight_window, [*stored, cotangent], [1] * (parts + 1), rows,
                                                   windows, halos=[h] * parts + [0], axes=axes)
    # the input gradients only after the kernel gradient: the inputs are then dead
    cotangent, d_kernels = jax.lax.optimization_barrier((cotangent, d_kernels))

    def input_window(dy):
        n = dy.shape[1] - 2 * h
        pieces = []
        for shape, k in zip(shapes, kernels):
            window = jax.ShapeDtypeStruct((shape[0], n, *shape[2:]), compute)
            (d_x,) = jax.linear_transpose(
                lambda xw, k=k: convolve(jnp.pad(xw, [(0, 0), (2 * h, 2 * h), *across, (0, 0)]), k), window)(dy)
            pieces.append(d_x)
        return (), pieces

    # one device part's gradient is written in place of the cotangent where it has its shape and dtype (the
    # rows a window reads below its start kept aside before the window below writes them)
    fits = [OVERWRITE and not p and tuple(shape) == tuple(cotangent.shape) and x.dtype == cotangent.dtype
            for shape, x, p in zip(shapes, stored, parked)]
    overwrite = [None] * parts
    if any(fits):
        overwrite[fits.index(True)] = 0
    _, d_inputs = row_windows.over_rows(input_window, [cotangent], [1], rows, windows, halos=[h],
                                        out=[(shape, x.dtype, 1, p) for shape, x, p in zip(shapes, stored, parked)],
                                        overwrite=overwrite)
    grads = [None] * count
    grads[kernel_index] = jnp.concatenate(d_kernels, axis=-2).astype(kernel.dtype)
    if bias_index is not None:
        grads[bias_index] = d_bias.astype(bias.dtype)
    return grads, d_inputs  # (in the inputs' dtypes: over_rows writes each window in its buffer's)
