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
from keras_lms.offload.torch import step_memory


def eligible(unit, config, tensors, kwargs) -> bool:
    """Whether the call's backward may take the lean kernel: ``captures_moments``, ``lean_normalization`` on."""
    return config.lean_normalization and captures_moments(unit, tensors, kwargs)


def captures_moments(unit, tensors, kwargs) -> bool:
    """Whether the call's batch statistics can be kept (for the lean backward, or for recomputing its output:
    ``recompute``): Keras' own BatchNormalization (no renorm, not synchronized, its ``call`` not overridden),
    one input tensor, no mask. Whether it uses batch statistics (training and trainable) shows in the forward:
    only then are moments captured."""
    return (type(unit) is keras.layers.BatchNormalization and adapter.batchnorm_moments_hook(unit) is not None
            and len(tensors) == 1 and kwargs.get("mask") is None and tensors[0].ndim >= 2)


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
SLABS = step_memory.LEAN_SLABS
SLAB_ROWS = step_memory.LEAN_SLAB_ROWS


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
    for float64 inputs, and normalises in that dtype with gamma cast to it; so does this).

    The operations are those torch's autograd runs for Keras' ops (``keras.ops.moments``:
    ``var = mean(x**2) - mean**2``; ``keras.ops.batch_normalization``: ``(x - mean) * (rsqrt(var + eps) *
    gamma) + beta``), in the order its engine runs them, with ``c = x - mean``, ``r = rsqrt(var + eps)``,
    ``s = r * gamma`` and ``n`` positions per channel::

        dbeta = sum(dy);  ds = sum(dy * c);  dgamma = ds * r
        dvar = -0.5 * (ds * gamma) * r**3;  dmean = sum(-(dy * s)) + (-dvar) * (2 * mean)
        dx = (dy * s + (dvar / n) * (2 * x)) + dmean / n

    but per-channel quantities are computed once and the input-sized ones slab by slab (:func:`_slabs`):
    the temporaries are slab-sized, in the compute dtype, and the result is written into one tensor of ``x``'s
    dtype and layout. With one slab (inputs up to ``SLAB_ROWS`` positions) the sums are the same reductions as
    autograd's and the result is bit-identical to it (tests/offload/torch/test_lean_normalization.py); with several,
    the sums are added slab by slab (float32 rounding). torch's fused ``native_batch_norm_backward`` was tried
    first: another formula (1e-7 relative per call, 1.2e-5 on MobileNetV2's first BatchNorm after 52 more, above
    the zoo's 1e-5), and on the CPU its channels-last kernel sums each channel sequentially (9e-6 in dgamma at
    2x64^3x16).
    """
    mean, variance = moments
    compute = mean.dtype
    gamma = beta = None
    for var, value in zip(unit.trainable_variables, trainable):
        if unit.scale and var is unit.gamma:
            gamma = value
        elif unit.center and var is unit.beta:
            beta = value
    axis = unit.axis % x.ndim
    r = variance.add(unit.epsilon).rsqrt_()  # as keras.ops.batch_normalization computes it
    g = torch.ones_like(variance) if gamma is None else gamma.to(compute)
    s = r.mul(g)
    dx = torch.empty_like(x)
    slabs = _slabs([x, dy, dx], axis)
    rows = tuple(range(x.ndim - 1))
    sum_dy = torch.zeros_like(mean)
    ds = torch.zeros_like(mean)
    sum_grad_c = torch.zeros_like(mean)
    for xs, dys, _ in slabs:
        axes = rows[:dys.ndim - 1]
        dy32 = dys.to(compute)
        sum_dy += dy32.sum(axes)
        c = xs.to(compute) - mean
        ds += c.mul_(dy32).sum(axes)  # autograd: (dy * c), summed to gamma's shape
        del c
        sum_grad_c += dy32.mul(s).neg_().sum(axes)  # sum(-(dy * s))
        del dy32
    dgamma = ds.mul(r)
    dvar = ds.mul(g).mul(-0.5).mul(r.pow(3))  # rsqrt's backward: -0.5 * grad * result**3
    dmean = sum_grad_c + dvar.neg().mul(mean.mul(2))  # pow's backward: grad * (2 * mean)
    n = x.numel() // mean.numel()
    k_sq = dvar / n  # mean's backward: grad / n
    k_mean = dmean / n
    for xs, dys, dxs in slabs:
        t = xs.to(compute).mul(2).mul_(k_sq)
        t = dys.to(compute).mul(s).add_(t).add_(k_mean)
        dxs.copy_(t)
        del t
    grads = []
    for value in trainable:
        if value is gamma and gamma is not None:
            grads.append(dgamma.to(value.dtype))
        elif value is beta and beta is not None:
            grads.append(sum_dy.to(value.dtype))
        else:
            grads.append(None)
    return dx, grads
