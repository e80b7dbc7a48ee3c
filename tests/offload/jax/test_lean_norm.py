"""The lean BatchNormalization backward on the JAX back end (``keras_lms/offload/jax/lean_norm.py``): the wrapped
step equals the plain one (float32 to rounding, mixed_float16 within the mixed-precision tolerance), with centre
or scale off and another axis, with a spy that the lean pullback ran, and the controls that it does not with
``lean_normalization=False`` or for float64 inputs (Keras computes those in float32 on JAX). What it does to
memory is measured in the compiled H100 program (docs/jax_findings.md: the mixed_float16 cube)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_lms  # noqa: E402
from keras_lms.offload.jax import lean_norm  # noqa: E402
from tests.oracle import assert_matches  # noqa: E402

pytestmark = pytest.mark.jax

L = keras.layers


class Calls(list):
    """The input shapes the lean rule ran on; ``windows``: in how many windows of rows each ran."""


@pytest.fixture
def spy(monkeypatch):
    calls = Calls()
    original = lean_norm._grads

    def counting(spec, x, scale, cotangent):
        calls.append(x.shape)
        windows.append(spec[-1])
        return original(spec, x, scale, cotangent)

    windows = []
    calls.windows = windows

    monkeypatch.setattr(lean_norm, "_grads", counting)
    return calls


def _model(center=True, scale=True, axis=-1, dtype=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((10, 12, 3), dtype=dtype)
    # (no bias before a BatchNorm: its true gradient is 0, so both steps' are rounding noise under mixed precision)
    x = L.Conv2D(6, 3, padding="same", use_bias=False, dtype=dtype)(inputs)
    x = L.BatchNormalization(axis=axis, center=center, scale=scale, dtype=dtype)(x)
    x = L.ReLU(dtype=dtype)(x)
    x = L.Conv2D(4, 3, padding="same", use_bias=False, dtype=dtype)(x)
    x = L.ReLU(dtype=dtype)(L.BatchNormalization(dtype=dtype)(x))  # (not a linear path: docs/design.md, JAX)
    return keras.Model(inputs, L.Dense(2, dtype=dtype)(L.GlobalAveragePooling2D(dtype=dtype)(x)))


@pytest.mark.parametrize("slab_bytes", [0, 1], ids=["whole", "windows"])
@pytest.mark.parametrize("options", [{}, {"center": False}, {"scale": False}, {"axis": 1}])
def test_float32_matches_the_plain_step(options, slab_bytes, spy):
    """(The formula against float64 arithmetic on a random cotangent: within 2e-7, as JAX's own gradient.)
    ``slab_bytes=1``: one window per row of the axis after the batch's that is not the channels' (10 rows; 12 with
    ``axis=1``). Windows sum in another order: measured 4.3e-5 against 1.1e-5 whole, float32 rounding that two
    BatchNorms on 360 elements a channel amplify (the rule itself: test_row_windows, 1e-15 in float64)."""
    model = _model(**options)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab_bytes)
    x = np.random.default_rng(0).random((3, 10, 12, 3)).astype("float32")
    assert_matches(model, wrapped, x, tol=6e-5 if slab_bytes else 2e-5)
    assert len(spy) == 2, spy
    rows = 12 if options.get("axis") == 1 else 10
    assert spy.windows == ([10, rows] if slab_bytes else [1, 1]), spy.windows  # (in the backward's order)


@pytest.mark.parametrize("slab_bytes", [0, 64], ids=["whole", "windows"])
def test_mixed_float16_matches_the_plain_step(slab_bytes, spy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _model()
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab_bytes)
        assert_matches(model, wrapped, np.random.default_rng(0).random((3, 10, 12, 3)).astype("float32"), tol=2e-2)
    finally:
        keras.config.set_dtype_policy(previous)
    assert spy and all(len(shape) == 4 for shape in spy)
    # float16 inputs of 3x10x12x6 and 3x10x12x4 (4320 and 2880 bytes) in windows of at most 64 bytes: every row
    assert spy.windows == ([10, 10] if slab_bytes else [1, 1]), spy.windows


def test_controls_lean_normalization_off_and_float64(spy):
    model = _model()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, lean_normalization=False)
    assert_matches(model, wrapped, np.random.default_rng(0).random((3, 10, 12, 3)).astype("float32"), tol=2e-5)
    assert spy == []
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        model = _model(dtype="float64")
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
        assert_matches(model, wrapped, np.random.default_rng(0).random((3, 10, 12, 3)), tol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert spy == []
