"""Lean convolution on torch (issue 19): an offloaded Conv2D/Conv3D call with a linear activation is differentiated
with ``aten.convolution_backward`` on the swapped-in input (keras_lms/offload/torch/lean_conv.py), without
recomputing Keras' ``conv`` (two input copies and the output). Bit-identical to autograd; the control (the path
switched off) has a higher live-storage peak."""

import keras
import numpy as np
import pytest
import torch

import keras_lms
from benchmarks.models import build_unet
from benchmarks.torch_cpu_peak import step_peak
from keras_lms.offload import torch as lms_torch
from keras_lms.offload.torch import lean_conv, step_memory
from tests.oracle import compare_step

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("layer,shape", [
    (lambda: keras.layers.Conv3D(5, 3, padding="same"), (2, 6, 7, 8, 4)),
    (lambda: keras.layers.Conv2D(5, 3, padding="valid", use_bias=False), (3, 9, 8, 4)),
    (lambda: keras.layers.Conv2D(5, 1), (3, 9, 8, 4)),
    (lambda: keras.layers.Conv2D(5, (3, 5), padding="same"), (3, 9, 8, 4)),
])
def test_backward_is_bit_identical_to_autograd_through_keras_conv(layer, shape, policy):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        conv = layer()
        conv.build(shape)
        assert lean_conv.eligible(conv, [torch.zeros(shape)])
        x = torch.tensor(np.random.default_rng(0).normal(size=shape).astype("float32"))
        x = x.to(getattr(torch, conv.compute_dtype)).requires_grad_(True)
        from keras_lms import _keras_adapter as adapter

        trainable = list(adapter.raw_values(conv.trainable_variables))
        y = conv(x)
        dy = torch.tensor(np.random.default_rng(1).normal(size=tuple(y.shape))).to(y.dtype)
        ref = torch.autograd.grad(y, [x] + trainable, dy)
        autocast = None if policy == "float32" else "bfloat16"
        dx, grads = lean_conv.backward(conv, x.detach(), dy, trainable, autocast)
        for got, want in zip([dx] + grads, ref):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert dx.stride() == ref[0].stride()
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.mark.parametrize("layer", [
    lambda: keras.layers.Conv2D(4, 3, padding="same", activation="relu"),  # needs the output: recomputed
    lambda: keras.layers.Conv2D(4, 3, strides=2),
    lambda: keras.layers.Conv2D(4, 2, padding="same"),  # asymmetric padding: Keras pads explicitly
    lambda: keras.layers.Conv2D(4, 3, dilation_rate=2),
    lambda: keras.layers.Conv2DTranspose(4, 3),
    lambda: keras.layers.DepthwiseConv2D(3),
])
def test_other_convolutions_are_recomputed(layer):
    assert not step_memory.lean_convolution_call(layer())


def _unet_step(lean_convolution, monkeypatch):
    if not lean_convolution:
        monkeypatch.setattr(lean_conv, "eligible", lambda *args: False)
    keras.utils.set_random_seed(0)
    model = build_unet((32, 32, 32, 1), depth=2, base_filters=8)
    wrapped = keras_lms.wrap(model)
    wrapped.compile(optimizer="adam", loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.random((2, 32, 32, 32, 1)).astype("float32")
    y = (rng.random((2, 32, 32, 32, 1)) > 0.5).astype("float32")
    lms_torch.reset_transfer_stats()
    peak = step_peak(wrapped, x, y, gc_enabled=False)["peak"]
    return peak, lms_torch.transfer_stats()["lean_convolution_calls"]


def test_lean_convolution_lowers_the_peak_and_the_control_does_not(monkeypatch):
    """At the level-0 decoder convolution (a concatenation in) the recompute held two copies of its input and its
    output besides the gradients (measured: 24.1 -> 20.1 MiB on this U-Net)."""
    lean_peak, lean_calls = _unet_step(True, monkeypatch)
    with monkeypatch.context() as patch:
        plain_peak, plain_calls = _unet_step(False, patch)
    assert lean_calls > 0 and plain_calls == 0
    level0 = 2 * 32**3 * 8 * 4
    assert lean_peak <= plain_peak - level0, (lean_peak / 2**20, plain_peak / 2**20)


def test_wrapped_unet_is_bit_identical_with_lean_convolution():
    """With lean normalisation off, the wrapped step (lean convolutions taken) equals the plain one exactly."""
    keras.utils.set_random_seed(0)
    model = build_unet((16, 16, 16, 1), depth=2, base_filters=4)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, lean_normalization=False)
    x = np.random.default_rng(3).random((2, 16, 16, 16, 1)).astype("float32")
    lms_torch.reset_transfer_stats()
    result = compare_step(model, wrapped, x)
    assert lms_torch.transfer_stats()["lean_convolution_calls"] == 5  # every conv1 (no activation) of the U-Net
    assert max(result["grads"].values()) == 0.0 and result["loss"] == 0.0
