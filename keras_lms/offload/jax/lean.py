"""Lean backward rules for layers whose JAX gradient XLA compiles with a large temporary.

A transposed convolution whose kernel equals its strides (the U-Net up-sampling, ``Conv3DTranspose(f, 2,
strides=2)``) maps each input voxel to its own ``k x k x k`` output block. JAX differentiates it as a
convolution with ``lhs_dilation``; XLA's GPU pipeline (cuDNN takes no input dilation for a filter gradient)
materialises the input dilated to the output's size (``f32[C, N, 2D+1, 2H+1, 2W+1]``, 8x the input in 3D) for
the filter gradient: at full resolution the largest temporary of a 3D U-Net's step. Here the same gradients
are two contractions of the output cotangent, reshaped into blocks, with the input and the kernel:

    dW[a, o, c] = sum_{n, i} ct[n, i, a, o] * x[n, i, c]        dx[n, i, c] = sum_{a, o} ct[n, i, a, o] * W[a, o, c]

The forward stays Keras' own (bit-identical outputs); the gradients equal JAX's up to float summation order.

A max pooling whose pool size equals its strides ("valid", the U-Net down-sampling) is differentiated by JAX as
``select_and_scatter_add``: XLA scatters into a zero buffer of the input's size, and its CSE shares that zero
buffer with every ReLU of the same shape, so one input-sized buffer of zeros lives through the whole step. Here the
forward keeps, per window, the index of its first maximum (the element ``select_and_scatter_add`` picks: XLA's
select keeps the earlier element on ties), one byte per output element instead of the input, and the backward
places each output cotangent at that index: the same gradient, exactly, with nothing to scatter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from keras import activations, layers

from keras_lms.offload.jax import in_place, row_windows
from keras_lms.offload.jax.lean_norm import lean_batchnorm_pullback

__all__ = ["block_conv_transpose", "block_max_pool", "block_transpose_windows", "kernel_and_bias", "lean_pullback_for"]

_IN, _KERNEL = "pqr", "abe"


def block_conv_transpose(layer) -> bool:
    """``layer`` is a channels-last transposed convolution with kernel == strides, no dilation, no
    output padding and a linear activation (the gradient below is exact for those)."""
    if not isinstance(layer, (layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)):
        return False
    return (layer.data_format == "channels_last" and tuple(layer.kernel_size) == tuple(layer.strides)
            and all(d == 1 for d in layer.dilation_rate) and layer.output_padding is None
            and layer.activation in (activations.linear, None))


def kernel_and_bias(layer):
    """``(kernel index, bias index or None)`` in ``layer.trainable_variables``, or None when those variables are
    not exactly a kernel and (with ``use_bias``) a bias: the gradient rules here return exactly those."""
    variables = list(layer.trainable_variables)
    kernel_index = next((i for i, v in enumerate(variables) if v is layer.kernel), None)
    bias_index = next((i for i, v in enumerate(variables) if layer.use_bias and v is layer.bias), None)
    if kernel_index is None or len(variables) != 1 + (bias_index is not None):
        return None
    return kernel_index, bias_index


def block_transpose_windows(layer, x, slab_bytes: int) -> int:
    """How many windows of rows a block transposed convolution of input ``x`` runs in (forward and backward):
    its input and output (the cotangent) bytes over ``slab_bytes``."""
    output_bytes = row_windows.nbytes(x) // x.shape[-1] * math.prod(layer.kernel_size) * layer.filters
    return row_windows.window_count(row_windows.nbytes(x) + output_bytes, x.shape[1], slab_bytes)


def _grads(spec, x, kernel, bias, cotangent):
    """(trainable gradients in ``spec``'s order, [input gradient]) of a block transposed convolution, over windows
    of rows (`row_windows`) when ``spec`` has more than one: input row ``i`` reads cotangent rows ``k*i..k*i+k-1``
    only. The partial kernel and bias gradients are summed in float32 (float64 for float64 operands)."""
    nd, kernel_index, bias_index, count, windows = spec
    compute = cotangent.dtype
    k = kernel.shape[:nd]
    sub_in, sub_k = _IN[:nd], _KERNEL[:nd]
    sub_ct = "n" + "".join(i + a for i, a in zip(sub_in, sub_k)) + "o"
    w = kernel.astype(compute)
    total = jnp.promote_types(compute, jnp.float32)

    def window(xs, cts):
        blocks = [d for i, size in enumerate(xs.shape[1:-1]) for d in (size, k[i])]
        ct = cts.reshape(xs.shape[0], *blocks, cts.shape[-1])
        d_kernel = jnp.einsum(f"{sub_ct},n{sub_in}c->{sub_k}oc", ct, xs.astype(compute))
        d_bias = jnp.sum(cts, axis=tuple(range(cts.ndim - 1)))
        d_x = jnp.einsum(f"{sub_ct},{sub_k}oc->n{sub_in}c", ct, w)
        return (d_kernel.astype(total), d_bias.astype(total)), d_x

    (d_kernel, d_bias), d_x = row_windows.over_rows(window, [x, cotangent], [1, k[0]], x.shape[1], windows, 1,
                                                    out=(x.shape, x.dtype, 1))
    grads = [None] * count
    grads[kernel_index] = d_kernel.astype(kernel.dtype)
    if bias_index is not None:
        grads[bias_index] = d_bias.astype(bias.dtype)
    return grads, [d_x.astype(x.dtype)]


def block_max_pool(layer, input_shape) -> bool:
    """``layer`` is a channels-last max pooling with pool size == strides, "valid", windows tiling an input of
    ``input_shape`` (batch axis included) and at most 256 elements each (the argmax index is one byte). Also what
    the planner's ``JaxFacts.host_bytes`` counts such a call's host copy by."""
    if not isinstance(layer, (layers.MaxPooling1D, layers.MaxPooling2D, layers.MaxPooling3D)):
        return False
    pool, strides = tuple(layer.pool_size), tuple(layer.strides)
    spatial = tuple(input_shape[1:-1])
    return (layer.data_format == "channels_last" and pool == strides and layer.padding == "valid"
            and len(spatial) == len(pool) and all(s % p == 0 for s, p in zip(spatial, pool))
            and math.prod(pool) <= 256)


def _windows(x, pool):
    """``x`` (N, *spatial, C) as (N, *spatial // pool, C, prod(pool)), the window's elements in row-major order."""
    nd = len(pool)
    blocks = [d for size, p in zip(x.shape[1:-1], pool) for d in (size // p, p)]
    x = x.reshape(x.shape[0], *blocks, x.shape[-1])
    outer = [1 + 2 * i for i in range(nd)]
    inner = [2 + 2 * i for i in range(nd)]
    x = x.transpose(0, *outer, 1 + 2 * nd, *inner)
    return x.reshape(*x.shape[:nd + 2], -1)


def _pool_grads(pool, shape, index, cotangent):
    """([], [input gradient]) of a block max pooling from the first-maximum indices of its windows."""
    nd = len(pool)
    window = math.prod(pool)
    spread = jax.nn.one_hot(index, window, dtype=cotangent.dtype) * cotangent[..., None]
    spread = spread.reshape(*spread.shape[:nd + 2], *pool)  # (N, *outer, C, *pool)
    order = [0] + [j for i in range(nd) for j in (1 + i, nd + 2 + i)] + [nd + 1]
    return [], [spread.transpose(order).reshape(shape)]


def lean_pullback_for(layer, trainable, arrays, kwargs=None, normalization: bool = True, slab_bytes: int = 0):
    """A ``pullback_maker(trainable, arrays)`` for ``layer`` if it has a lean backward here (or, with
    ``normalization``, for a BatchNormalization called with ``kwargs``, in ``lean_norm``), else None. Backward
    rules whose operands exceed ``slab_bytes`` (``LMSConfig.slab_bytes``; 0: never) run over windows of rows.

    The maker returns a ``jax.tree_util.Partial`` whose leaves are the residuals (input, kernel, bias) and which,
    called with the output cotangent, returns ``(trainable_grads, [input_grad])`` like ``jax.vjp``'s pullback.
    """
    lean_norm = lean_batchnorm_pullback(layer, trainable, arrays, kwargs or {}, slab_bytes) if normalization else None
    if lean_norm is not None:
        return lean_norm
    relu = in_place.relu_pullback(layer, arrays, kwargs or {}, slab_bytes)
    if relu is not None:
        return relu
    if len(arrays) == 1 and block_max_pool(layer, arrays[0].shape) and not trainable:
        pool = tuple(layer.pool_size)

        def make_pool(trainable, arrays):
            index = jnp.argmax(_windows(arrays[0], pool), axis=-1).astype(jnp.uint8)
            return jax.tree_util.Partial(functools.partial(_pool_grads, pool, arrays[0].shape), index)

        return make_pool
    if not block_conv_transpose(layer) or len(arrays) != 1:
        return None
    indices = kernel_and_bias(layer)
    if indices is None:
        return None
    kernel_index, bias_index = indices
    windows = block_transpose_windows(layer, arrays[0], slab_bytes)
    spec = (len(layer.kernel_size), kernel_index, bias_index, len(layer.trainable_variables), windows)

    def make(trainable, arrays):
        bias = trainable[bias_index] if bias_index is not None else jnp.zeros((), trainable[kernel_index].dtype)
        return jax.tree_util.Partial(functools.partial(_grads, spec), arrays[0], trainable[kernel_index], bias)

    make.streams_host_rows = windows > 1  # the input read a window of rows at a time (host_residuals)
    return make
