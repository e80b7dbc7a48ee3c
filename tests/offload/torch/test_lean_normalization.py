"""Lean normalisation on torch (issue 19): an offloaded BatchNormalization call (training, batch statistics) is
differentiated from the forward's saved statistics (keras_lms/offload/torch/lean_norm.py) instead of recomputing
Keras' normalisation ops, whose backward holds about six input-sized float32 temporaries.

What is checked: the lean path is taken (a counter) and lowers the live-storage peak of a U-Net step against
``lean_normalization=False`` (the negative control, which recomputes); its gradients match the plain model within
the zoo's tolerance in float32 and mixed_bfloat16, and to ~1e-15 in float64 once Keras computes BatchNormalization
in float64 (on torch Keras demotes it to float32: see test_float64_models_keep_the_exact_recompute); the moving
statistics are Keras' own, bit for bit; ``lean_normalization=False`` is bit-identical to the plain model.
"""

import keras
import numpy as np
import pytest
import torch

import keras_lms
from benchmarks.models import build_unet
from benchmarks.torch_cpu_peak import step_peak
from keras_lms.offload import torch as lms_torch
from keras_lms.offload.torch import lean_norm
from tests import models
from tests.oracle import assert_matches, compare_step

pytestmark = pytest.mark.torch


def _unet(size=16, depth=2, filters=4):
    keras.utils.set_random_seed(0)
    return build_unet((size, size, size, 1), depth=depth, base_filters=filters)


def _unet_any_dtype():
    return models.bn_relu_unet3d()


def _images(size=16, batch=2, offset=0.0):
    return (np.random.default_rng(3).random((batch, size, size, size, 1)) + offset).astype("float32")


def _batchnorms(model):
    return sum(isinstance(layer, keras.layers.BatchNormalization) for layer in keras_lms.unwrap(model).layers)


def _lean_calls(model, x):
    lms_torch.reset_transfer_stats()
    compare_step(keras_lms.unwrap(model), model, x)
    return lms_torch.transfer_stats()["lean_normalization_calls"]


def test_lean_path_lowers_the_live_storage_peak_of_a_unet_step():
    """The wall of issue 19 on a small 3D U-Net: the level-0 BatchNorm backward. With the lean path the step's
    live-storage peak (GC off, host buffers apart) is lower than with Keras' ops recomputed (the control)."""
    rng = np.random.default_rng(0)
    x = rng.random((2, 32, 32, 32, 1)).astype("float32")
    y = (rng.random((2, 32, 32, 32, 1)) > 0.5).astype("float32")
    peaks, calls = {}, {}
    for lean in (False, True):
        model = _unet(32, depth=2, filters=8)
        wrapped = keras_lms.wrap(model, lean_normalization=lean)
        wrapped.compile(optimizer="adam", loss="binary_crossentropy")
        lms_torch.reset_transfer_stats()
        peaks[lean] = step_peak(wrapped, x, y, gc_enabled=False)["peak"]
        calls[lean] = lms_torch.transfer_stats()["lean_normalization_calls"]
    assert calls[False] == 0 and calls[True] > 0, calls
    level0 = 2 * 32**3 * 8 * 4  # one level-0 activation (8 channels, float32): 2 MiB
    # the recompute's temporaries at the level-0 BatchNorm backward (measured: 28.0 -> 24.1 MiB, 1.9 level-0
    # activations; the peak moves to the level-0 convolution's backward)
    assert peaks[True] <= peaks[False] - 1.5 * level0, {k: v / 2**20 for k, v in peaks.items()}


@pytest.mark.parametrize("settings", [dict(min_bytes=0, keep_last=0, prefetch=0), dict(min_bytes=0, prefetch=2)],
                         ids=["all-prefetch0", "keep1-prefetch2"])
def test_lean_gradients_match_plain_within_the_zoo_tolerance(settings):
    """Inputs with a mean large against their spread (offset 4) are where the plain ops' E[x^2] - E[x]^2 and
    the kernel's rounding differ most; the state after the step (moving statistics) is bit-identical."""
    model = _unet()
    wrapped = keras_lms.wrap(model, **settings)
    x = _images(offset=4.0)
    result = assert_matches(model, wrapped, x, tol=1e-5)
    assert max(result["state"].values()) == 0.0
    assert any("moving_mean" in p for p in result["state_changed"])
    assert _lean_calls(wrapped, x) == _batchnorms(wrapped) == 5


def test_lean_normalization_false_is_bit_identical_to_plain():
    model = _unet()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, lean_normalization=False)
    x = _images(offset=4.0)
    result = compare_step(model, wrapped, x)
    assert max(result["grads"].values()) == 0.0 and max(result["state"].values()) == 0.0
    assert _lean_calls(wrapped, x) == 0


def test_one_slab_is_bit_identical_and_several_are_rounding_sized(monkeypatch):
    """Up to SLAB_ROWS positions the lean backward runs autograd's operations on the same reductions: bit-identical
    to the plain model. With several slabs (forced here by a small SLAB_ROWS) the per-channel sums are added slab
    by slab: not bit-identical (the control that the lean path really ran), float32 rounding (<= 1e-5)."""
    x = _images(offset=4.0)
    model = _unet()
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0), x)
    assert max(result["grads"].values()) == 0.0
    monkeypatch.setattr(lean_norm, "SLAB_ROWS", 64)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    result = compare_step(model, wrapped, x)
    worst = max(result["grads"].values())
    assert 0.0 < worst <= 1e-5, worst
    assert _lean_calls(wrapped, x) == 5


def test_mixed_bfloat16_matches_plain():
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        model = _unet()
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
        x = _images()
        result = assert_matches(model, wrapped, x, tol=1e-3)
        assert max(result["state"].values()) == 0.0
        assert _lean_calls(wrapped, x) == _batchnorms(wrapped) == 5
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture
def float64_batchnorm(monkeypatch):
    """Keras computes BatchNormalization in float64 for float64 inputs: on torch ``result_type`` demotes 64-bit
    types to 32-bit (``BIT64_TO_BIT32_DTYPE``, JAX's default), so a float64 model's BatchNorm runs in float32."""
    from keras.src.backend.common import dtypes

    monkeypatch.setitem(dtypes.BIT64_TO_BIT32_DTYPE, "float64", "float64")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")


def test_float64_difference_shrinks_to_rounding(float64_batchnorm, monkeypatch):
    """With several slabs, the lean gradient matches the plain model's to <= 1e-12 in float64 (measured: 0 on this
    model, 4.1e-15 worst on the oracle models): the float32 differences of several slabs are rounding."""
    monkeypatch.setattr(lean_norm, "SLAB_ROWS", 64)
    model = _unet_any_dtype()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x = _images(offset=4.0).astype("float64")
    assert_matches(model, wrapped, x, tol=1e-12)
    assert _lean_calls(wrapped, x) == _batchnorms(wrapped) == 6  # the lean path ran, in 16 slabs per call


def test_float64_models_keep_the_exact_recompute(dtype_policy_float64):
    """Without the fixture above, Keras' torch BatchNormalization computes a float64 model's statistics in float32;
    the lean path then would differ from the plain model by float32 rounding, so the recompute is kept: exact."""
    model = _unet_any_dtype()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x = _images(offset=4.0).astype("float64")
    result = compare_step(model, wrapped, x)
    assert max(result["grads"].values()) == 0.0
    assert _lean_calls(wrapped, x) == 0


@pytest.fixture
def dtype_policy_float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("axis,shape", [(-1, (3, 5, 7, 6)), (1, (4, 6, 5, 5)), (-1, (40000, 3))])
def test_kernel_matches_autograd_of_keras_ops_in_float64(float64_batchnorm, axis, shape, monkeypatch):
    """``lean_norm.backward`` against torch autograd through Keras' own BatchNormalization call (float64), with
    channels last, channels first (slabs along the batch axis) and many rows (several slabs)."""
    monkeypatch.setattr(lean_norm, "SLAB_ROWS", 4096)
    bn = keras.layers.BatchNormalization(axis=axis)
    bn.build(shape)
    bn.gamma.assign(np.linspace(0.5, 1.5, bn.gamma.shape[0]))
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=shape) * 0.3 + 2.0, requires_grad=True)
    dy = torch.tensor(rng.normal(size=shape))
    record = type("Record", (), {})()
    with lean_norm.capturing_moments(bn, record, x):
        y = bn(x, training=True)
    dx_ref, dg_ref, db_ref = torch.autograd.grad(y, [x, bn.gamma.value, bn.beta.value], dy)
    dx, (dg, db) = lean_norm.backward(bn, x.detach(), dy, [bn.gamma.value, bn.beta.value], record.moments)
    for got, ref in ((dx, dx_ref), (dg, dg_ref), (db, db_ref)):
        assert float((got - ref).norm() / ref.norm()) < 1e-13
    assert dx.stride() == x.stride()


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("shape,offset", [((3, 5, 7, 6), 2.0), ((2, 4, 4, 4, 8), 0.0), ((40, 3), 5.0)])
def test_one_slab_is_bit_identical_to_autograd_of_keras_ops(policy, shape, offset):
    from keras_lms import _keras_adapter as adapter

    keras.mixed_precision.set_dtype_policy(policy)
    try:
        bn = keras.layers.BatchNormalization()
        bn.build(shape)
        bn.gamma.assign(np.linspace(0.5, 1.5, shape[-1]))
        rng = np.random.default_rng(0)
        x = torch.tensor((rng.normal(size=shape) * 0.3 + offset).astype("float32"))
        x = x.to(getattr(torch, bn.compute_dtype)).requires_grad_(True)
        dy = torch.tensor(rng.normal(size=shape).astype("float32")).to(x.dtype)
        values = list(adapter.raw_values(bn.trainable_variables))
        record = type("Record", (), {})()
        with lean_norm.capturing_moments(bn, record, x):
            y = bn(x, training=True)
        ref = torch.autograd.grad(y, [x] + values, dy)
        dx, grads = lean_norm.backward(bn, x.detach(), dy, values, record.moments)
        for got, want in zip([dx] + grads, ref):
            assert got.dtype == want.dtype and torch.equal(got, want)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
