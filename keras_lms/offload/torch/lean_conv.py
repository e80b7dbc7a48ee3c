"""Lean convolution: the backward of an offloaded Keras Conv2D/Conv3D call without recomputing its forward.

A convolution's gradient needs its input and kernel, not its output. Recomputing Keras' ``conv`` in the backward
makes two copies of the swapped-in input (``permute(...).contiguous()``, then ``contiguous(channels_last)``, the
second saved by autograd) and the output, none of which the gradient needs: at the level-0 decoder convolution of
a 3D U-Net (a concatenation in, 2 of its 8 input-sized buffers) that was the wrapped step's peak once BatchNorm
went lean. Here the backward calls ``aten.convolution_backward`` itself with exactly the tensors autograd gives it
in the plain model: the gradient permuted to channels-first (a view), the input as the channels-last view Keras'
copy equals, and Keras' channels-last copy of the kernel (cast as the forward's autocast cast it); the bias
gradient is ``sum_to_size`` as ``add``'s backward computes it. The results are bit-identical to autograd's
(tests/offload/torch/test_lean_normalization.py compares them), so there is no option to turn it off.

Only where Keras' torch ``conv`` passes its arguments straight to torch: Keras' own Conv2D/Conv3D ``call``,
channels last, stride 1, dilation 1, one group, ``padding="valid"`` or ``"same"`` with odd kernel sizes
(symmetric padding, no explicit ``pad``), a linear activation, no LoRA, not quantized.
"""

from __future__ import annotations

import keras
import torch

from keras_lms import _keras_adapter as adapter
from keras_lms.offload.torch import step_memory


def eligible(unit, tensors) -> bool:
    """Whether an offloaded call of ``unit`` on ``tensors`` may be differentiated without recompute."""
    return (step_memory.lean_convolution_call(unit) and len(tensors) == 1 and tensors[0].ndim == unit.rank + 2
            and not adapter.is_quantized(unit))


def _memory_format(rank):
    return torch.channels_last_3d if rank == 3 else torch.channels_last


@torch.no_grad()
def backward(unit, x, dy, trainable, autocast_dtype):
    """``(dx, [gradient per trainable value])`` of the call ``unit(x)`` at ``dy`` (see the module docstring)."""
    rank = unit.rank
    to_first = (0, rank + 1) + tuple(range(1, rank + 1))
    fmt = _memory_format(rank)
    kernel = bias = None
    for var, value in zip(unit.trainable_variables, trainable):
        if var is unit.kernel:
            kernel = value
        elif unit.use_bias and var is unit.bias:
            bias = value
    weight = kernel
    if autocast_dtype is not None and weight.is_floating_point():
        weight = weight.to(getattr(torch, keras.backend.standardize_dtype(autocast_dtype)))
    # Keras: kernel (k..., in, out) -> (out, in, k...), channels-last copy
    weight = weight.permute((rank + 1, rank) + tuple(range(rank))).contiguous(memory_format=fmt)
    xv = x.permute(to_first)
    if not xv.is_contiguous(memory_format=fmt):
        xv = xv.contiguous(memory_format=fmt)
    dyv = dy.permute(to_first)
    padding = [0] * rank if unit.padding == "valid" else [(k - 1) // 2 for k in unit.kernel_size]
    dx, dw, _ = torch.ops.aten.convolution_backward(
        dyv, xv, weight, None, [1] * rank, padding, [1] * rank, False, [0] * rank, 1,
        [True, kernel is not None, False])
    dx = dx.permute((0,) + tuple(range(2, rank + 2)) + (1,))
    grads = []
    for value in trainable:
        if value is kernel:
            grads.append(dw.permute(tuple(range(2, rank + 2)) + (1, 0)).to(value.dtype))
        elif value is bias:
            db = dy.sum_to_size((1,) * (rank + 1) + (unit.filters,)).reshape(unit.filters)
            grads.append(db.to(value.dtype))
        else:
            grads.append(None)
    return dx, grads

