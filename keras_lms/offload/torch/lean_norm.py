"""Lean normalisation: the backward of an offloaded BatchNormalization call without recompute or big temporaries.

Keras' torch BatchNormalization (training, batch statistics) computes the moments and the normalisation with
separate ops, in float32 even for float16/bfloat16 inputs: differentiating its recompute holds about six
input-sized float32 temporaries (the cast input, the centred input autograd saves, and the backward's
products), which made the level-0 BatchNorm backward the wrapped U-Net's peak. Here the forward pass is Keras'
own (output, moving statistics and all); only the batch mean and variance it computes (per channel, tiny) are
kept. The backward does not recompute the call: it evaluates the batch-norm gradient that torch's fused
``native_batch_norm_backward`` computes, from the input brought back from the host, the saved statistics and
``invstd = rsqrt(variance + epsilon)`` computed as Keras computes it, slab by slab so that the float32
temporaries are a fraction of the input (:func:`backward`). The result is the exact gradient of Keras' function
up to rounding (``LMSConfig.lean_normalization=False`` recomputes Keras' ops instead; docs/design.md, "Lean
normalisation (torch)").
"""

from __future__ import annotations

import contextlib

import keras
import torch

from keras_lms import _keras_adapter as adapter
from keras_lms import layer_facts


def eligible(unit, config, tensors, kwargs) -> bool:
    """Whether the call's backward may take the lean kernel: Keras' own BatchNormalization (no renorm, not
    synchronized, its ``call`` not overridden), one input tensor, no mask, ``lean_normalization`` on. Whether
    it uses batch statistics (training and trainable) shows in the forward: only then are moments captured."""
    return (config.lean_normalization and type(unit) is keras.layers.BatchNormalization
            and adapter.batchnorm_moments_hook(unit) is not None and len(tensors) == 1
            and kwargs.get("mask") is None and tensors[0].ndim >= 2)


@contextlib.contextmanager
def capturing_moments(unit, record, x):
    """Around the forward call on ``x``: keep the batch (mean, variance) Keras computes in ``record.moments``.

    ``None`` (the backward recomputes Keras' ops) when the call computed none (inference statistics), more
    than one, or statistics narrower than ``x``: Keras on torch computes a float64 model's BatchNormalization
    in float32 (``keras.backend.result_type`` demotes 64-bit types on every back end but TensorFlow), and
    there the plain gradient carries float32 rounding that only the recompute reproduces exactly.
    """
    hook = adapter.batchnorm_moments_hook(unit)
    original = getattr(unit, hook)
    seen = []

    def recording_moments(inputs, mask):
        mean, variance = original(inputs, mask)
        seen.append(None if mask is not None else (mean.detach(), variance.detach()))
        return mean, variance

    with adapter.patched_attribute(unit, hook, recording_moments):
        yield
    moments = seen[0] if len(seen) == 1 else None
    if moments is not None and moments[0].dtype.itemsize < x.dtype.itemsize:
        moments = None
    record.moments = moments


# Rows (positions along every axis but the channels) per slab: the backward's float32 temporaries are at most
# max(SLAB_ROWS, rows / SLABS) x channels elements, however large the input (the planner models the same).
SLABS = layer_facts.LEAN_SLABS
SLAB_ROWS = layer_facts.LEAN_SLAB_ROWS


def _slabs(tensors, axis):
    """Views of the same-shaped ``tensors`` with the channel axis last, cut into the same slabs of rows:
    ``[(slab of tensors[0], slab of tensors[1], ...), ...]``; nothing is copied."""
    moved = [t.movedim(axis, -1) for t in tensors]
    channels = moved[0].shape[-1]
    rows = moved[0].numel() // max(channels, 1)
    if all(t.is_contiguous() for t in moved):
        flat = [t.view(rows, channels) for t in moved]
        step = max(SLAB_ROWS, -(-rows // SLABS))
        return [tuple(f[i:i + step] for f in flat) for i in range(0, rows, step)]
    if moved[0].ndim == 1:
        return [tuple(moved)]
    parts = min(moved[0].shape[0], SLABS)
    return list(zip(*(torch.tensor_split(t, parts, dim=0) for t in moved)))


@torch.no_grad()
def backward(unit, x, dy, trainable, moments):
    """``(dx, [gradient per trainable value])`` of the BatchNormalization call ``unit(x)`` at ``dy``.

    ``trainable`` are the values of ``unit.trainable_variables`` the forward used, ``moments`` the batch
    statistics it computed (Keras computes them in ``result_type(x.dtype, float32)``, float32 on torch even
    for float64 inputs, and normalises in that dtype with gamma cast to it; so does this). With
    ``xmu = x - mean``, ``n`` positions per channel and ``k = gamma * invstd``:

        dbeta = sum(dy);  dot = sum(dy * xmu);  dgamma = dot * invstd
        dx = k * (dy - dbeta / n - xmu * invstd**2 * dot / n)

    the gradient torch's ``native_batch_norm_backward`` computes (from the saved mean and invstd), evaluated
    slab by slab (:func:`_slabs`) with torch's own (pairwise) reductions: the temporaries are slab-sized and
    in the compute dtype, the result is written into one tensor of ``x``'s dtype and layout. (torch's CPU
    kernel for channels-last inputs accumulates each channel's sums sequentially: measured 9e-6 relative
    error in dgamma at 2x64^3x16 against 5e-7 for Keras' own ops, which would exceed the 1e-5 tolerance.)
    """
    mean, variance = moments
    compute = mean.dtype
    variables = list(unit.trainable_variables)
    gamma = beta = None
    for var, value in zip(variables, trainable):
        if unit.scale and var is unit.gamma:
            gamma = value
        elif unit.center and var is unit.beta:
            beta = value
    axis = unit.axis % x.ndim
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    invstd = variance.add(unit.epsilon).rsqrt_()  # as keras.ops.batch_normalization computes it
    reduce_axes = tuple(range(x.ndim - 1))
    dx = torch.empty_like(x)
    slabs = _slabs([x, dy, dx], axis)
    sum_dy = torch.zeros_like(mean)
    dot = torch.zeros_like(mean)
    for xs, dys, _ in slabs:
        sum_dy += dys.sum(reduce_axes[:dys.ndim - 1], dtype=compute)
        xmu = xs.to(compute) - mean
        dot += xmu.mul_(dys).sum(reduce_axes[:dys.ndim - 1])
        del xmu
    n = x.numel() // mean.numel()
    scale = invstd if gamma is None else invstd * gamma.to(compute)
    proj = invstd * invstd * dot / n  # the part of dy along xmu, per unit of xmu
    mean_dy = sum_dy / n
    for xs, dys, dxs in slabs:
        t = xs.to(compute) - mean
        t.mul_(proj).neg_().add_(dys).sub_(mean_dy).mul_(scale)
        dxs.copy_(t)
        del t
    grads = []
    for value in trainable:
        if value is gamma and gamma is not None:
            grads.append((dot * invstd).to(value.dtype))
        elif value is beta and beta is not None:
            grads.append(sum_dy.to(value.dtype))
        else:
            grads.append(None)
    return dx, grads
