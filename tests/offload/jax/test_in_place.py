"""Element-wise forwards, ReLU's backward and same-shape windowed convolutions written over their operand a window
of rows at a time (``keras_lms/offload/jax/in_place.py``, ``convolutions._over_input``) on the JAX back end.

The wrapped step equals the plain one (loss, outputs, gradients, BatchNorm moving statistics) with every such call
in windows, in float32, mixed_float16 and float64 (mixed_bfloat16: no further from plain than without the in-place
calls), with spies that the in-place calls ran, and the same step with ``IN_PLACE`` off as the control that the
spies can fail. What it does to device memory is measured in the compiled H100 program
(tests/offload/jax/test_compiled_offload.py; docs/jax_findings.md, session 21).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_lms  # noqa: E402
from keras_lms.offload.jax import convolutions, in_place  # noqa: E402
from tests.oracle import assert_matches, compare_step  # noqa: E402

pytestmark = pytest.mark.jax

L = keras.layers


@pytest.fixture
def spy(monkeypatch):
    """The layers whose forward ran in place, whose ReLU backward ran in place, and the windowed convolutions
    written over their input."""
    seen = {"forward": [], "relu_backward": [], "convolution": []}
    forward, relu, over = in_place.in_place_call, in_place._relu_grads, convolutions._over_input

    def counting_forward(layer, original, windows):
        seen["forward"].append((layer.name, windows))
        return forward(layer, original, windows)

    def counting_relu(windows, mask, cotangent):
        seen["relu_backward"].append(windows)
        return relu(windows, mask, cotangent)

    def counting_over(inputs, shape):
        result = over(inputs, shape)
        seen["convolution"].append(result)
        return result

    monkeypatch.setattr(in_place, "in_place_call", counting_forward)
    monkeypatch.setattr(in_place, "_relu_grads", counting_relu)
    monkeypatch.setattr(convolutions, "_over_input", counting_over)
    return seen


def _model(dtype=None):
    """Conv3D-BN-ReLU twice (the second convolution of the same shape as its input), LeakyReLU, an Activation."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8, 6, 5, 2), dtype=dtype)
    x = L.Conv3D(4, 3, padding="same", use_bias=False, dtype=dtype, name="c1")(inputs)
    x = L.ReLU(dtype=dtype, name="r1")(L.BatchNormalization(dtype=dtype, name="bn1")(x))
    x = L.Conv3D(4, 3, padding="same", use_bias=False, dtype=dtype, name="c2")(x)
    x = L.BatchNormalization(center=False, dtype=dtype, name="bn2")(x)
    x = L.LeakyReLU(0.2, dtype=dtype, name="leaky")(x)
    x = L.Activation("tanh", dtype=dtype, name="tanh")(L.Conv3D(3, 1, dtype=dtype, name="c3")(x))
    pooled = L.GlobalAveragePooling3D(dtype=dtype, name="pool")(x)
    return keras.Model(inputs, L.Dense(2, dtype=dtype, name="head")(pooled))


def _x():
    return np.random.default_rng(1).random((2, 8, 6, 5, 2)).astype("float32")


def _check_ran(spy):
    names = [name for name, _ in spy["forward"]]
    assert names == ["bn1", "r1", "bn2", "leaky", "tanh"], spy["forward"]
    assert all(windows == 8 for _, windows in spy["forward"]), spy["forward"]  # one row per window
    assert spy["relu_backward"] == [8], spy["relu_backward"]  # (the plain ReLU's; LeakyReLU keeps JAX's)
    assert spy["convolution"] == [None, 0], spy["convolution"]  # c1 changes channels; c2 is written over


def test_float32_matches_the_plain_step_with_every_call_in_place(spy):
    """``slab_bytes=1``: every call of a 5-D tensor in windows of one row. The in-place calls compute the same
    elements with the same operations, so the differences are the windowed convolutions' summation order."""
    model = _model()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=1)
    assert_matches(model, wrapped, _x(), tol=5e-5)
    _check_ran(spy)


def test_mixed_float16_matches_the_plain_step(spy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _model()
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=1)
        assert_matches(model, wrapped, _x(), tol=2e-2)
    finally:
        keras.config.set_dtype_policy(previous)
    _check_ran(spy)


def test_mixed_bfloat16_differs_from_plain_no_more_than_without_the_in_place_calls(spy, monkeypatch):
    """Under mixed_bfloat16 the wrapped step differs from the plain one by bfloat16 rounding (XLA fuses the two
    programs differently: measured 6.4e-2 on a kernel gradient, the same with every in-place call off and with no
    windows at all); the in-place calls add nothing to it: the loss, state and every gradient's difference equal
    the control's to 1e-3."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        results = []
        for on in (True, False):
            monkeypatch.setattr(in_place, "IN_PLACE", on)
            model = _model()
            results.append(compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=1), _x()))
    finally:
        keras.config.set_dtype_policy(previous)
    (on, off), names = results, spy["forward"]
    assert [name for name, _ in names] == ["bn1", "r1", "bn2", "leaky", "tanh"], names  # (the IN_PLACE run only)
    assert abs(on["loss"] - off["loss"]) <= 1e-3 and on["grads"].keys() == off["grads"].keys()
    for key in on["grads"]:
        assert abs(on["grads"][key] - off["grads"][key]) <= 1e-3, (key, on["grads"][key], off["grads"][key])
    for key in on["state"]:
        assert abs(on["state"][key] - off["state"][key]) <= 1e-3, (key, on["state"][key], off["state"][key])


def test_float64_is_exact_and_the_control_runs_nothing_in_place(spy, monkeypatch):
    """In float64 (Keras computes BatchNorm in float32 there, so it keeps JAX's own backward and forward) the
    activations and convolutions in place agree with plain to 1e-12; with ``IN_PLACE`` off nothing runs in place
    and the step is the same."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        model = _model(dtype="float64")
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=1)
        assert_matches(model, wrapped, _x().astype("float64"), tol=1e-12)
        assert [name for name, _ in spy["forward"]] == ["r1", "leaky", "tanh"], spy["forward"]
        assert 0 in spy["convolution"]
        for kind in spy:
            spy[kind].clear()
        monkeypatch.setattr(in_place, "IN_PLACE", False)
        model = _model(dtype="float64")
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=1)
        assert_matches(model, wrapped, _x().astype("float64"), tol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert spy["forward"] == [] and spy["relu_backward"] == [], spy
    assert set(spy["convolution"]) == {None}, spy["convolution"]


def test_which_calls_run_in_place():
    """Windows only for inputs over ``slab_bytes`` of rank >= 3, BatchNorm only in training with batch statistics
    over the last axis, activations only for Keras' element-wise ones; 1 otherwise."""
    x = jax.numpy.zeros((1, 8, 4, 4, 2), "float32")  # 1 KiB
    bn = L.BatchNormalization()
    bn.build(x.shape)
    assert in_place.in_place_windows(bn, (x,), {"training": True}, 256) == 4
    assert in_place.in_place_windows(bn, (x,), {"training": False}, 256) == 1  # moving statistics: not handled
    assert in_place.in_place_windows(bn, (x,), {"training": True}, 0) == 1  # no slabs
    assert in_place.in_place_windows(bn, (x,), {"training": True}, 4096) == 1  # small
    first = L.BatchNormalization(axis=1)
    first.build(x.shape)
    assert in_place.in_place_windows(first, (x,), {"training": True}, 256) == 1
    assert in_place.in_place_windows(L.ReLU(), (x,), {}, 256) == 4
    assert in_place.in_place_windows(L.Activation("softmax"), (x,), {}, 256) == 1  # not element-wise
    assert in_place.in_place_windows(L.Conv3D(2, 1), (x,), {}, 256) == 1  # a convolution: convolutions.py
    assert in_place.in_place_windows(L.ReLU(), (x[0, 0],), {}, 256) == 1  # rank 3 ... of a 2-D map
    assert in_place.relu_pullback(L.ReLU(max_value=6.0), (x,), {}, 256) is None  # JAX's own backward
    assert in_place.relu_pullback(L.ReLU(), (x,), {}, 256) is not None


@pytest.mark.slow
def test_an_application_matches_plain_with_calls_in_place(spy):
    """A real architecture (tests/models.py's keras.applications zoo, ``weights=None``) wrapped with 64 KiB slabs,
    so that its BatchNorms and activations run in place: the step matches plain within the zoo's JAX tolerance
    (tests/test_applications.py). Xception: 75 calls in place, measured 2.5e-6; ResNet50 (9 calls in place,
    3.9e-5) and the rest of the zoo in docs/jax_findings.md, session 21 (ResNet50 left CI in session 26, 43-87 s;
    it stays in the JAX zoo oracle without in-place slabs)."""
    from tests import models
    from tests.test_applications import JAX_TOLERANCE

    build, size, dtype, _ = models.APPLICATIONS["Xception"]
    keras.utils.set_random_seed(0)
    model = build()
    x = np.random.default_rng(0).random((2, size, size, 3)).astype(dtype)
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=1, slab_bytes="64KiB"), x,
                   tol=JAX_TOLERANCE[dtype])
    assert len(spy["forward"]) >= 70, len(spy["forward"])
