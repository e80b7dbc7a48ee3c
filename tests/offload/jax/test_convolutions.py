"""Offloaded convolutions on the JAX back end computed over a concatenation's parts and, when their input is larger
than ``slab_bytes``, forward and backward in windows of rows (``keras_lms/offload/jax/convolutions.py``,
``convolution_backward.py``): the same step as the
plain model (float64 to rounding; mixed_float16 within the zoo's tolerance), with a spy that the rewrites ran
and the control that they do not when switched off. What they do to memory is checked in the compiled H100
program (test_compiled_offload.py)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_lms  # noqa: E402
from benchmarks.models import unet  # noqa: E402
from keras_lms.offload.jax import convolution_backward, convolutions, parking, row_windows  # noqa: E402
from tests.oracle import assert_matches  # noqa: E402

pytestmark = pytest.mark.jax

L = keras.layers


@pytest.fixture
def spy(monkeypatch):
    """Counts the convolutions computed over parts, the windows the forwards ran in, the backwards run in
    windows, the windows of block transposed convolutions' forwards, the tensors parked on host and the parts
    a windowed forward read from host."""
    seen = {"parts": 0, "windows": 0, "backward": 0, "transposed": 0, "parked": 0, "host_parts": 0}
    park = parking.ParkedTensors.park

    def counting_park(self, tensor, windows):
        seen["parked"] += 1
        return park(self, tensor, windows)

    monkeypatch.setattr(parking.ParkedTensors, "park", counting_park)
    original = convolutions._convolve
    backward = convolution_backward._grads
    block_transpose_call = convolutions.block_transpose_call

    def counting_transposed(layer, call, windows):
        seen["transposed"] += windows
        return block_transpose_call(layer, call, windows)

    monkeypatch.setattr(convolutions, "block_transpose_call", counting_transposed)

    def counting_backward(spec, *args):
        seen["backward"] += 1
        return backward(spec, *args)

    monkeypatch.setattr(convolution_backward, "_grads", counting_backward)

    def counting(layer, op, inputs, kernel, windows):
        seen["parts"] += len(inputs) > 1
        seen["windows"] += windows if windows > 1 else 0
        seen["host_parts"] += sum(row_windows.on_host(x) for x in inputs)
        return original(layer, op, inputs, kernel, windows)

    monkeypatch.setattr(convolutions, "_convolve", counting)
    return seen


def _dilated_model(dtype):
    """A concatenation read by a dilated 5x3 convolution and by a 1x1 one, beside a windowable 3D-free path."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((12, 10, 2), dtype=dtype)
    a = L.Conv2D(3, 3, padding="same", dtype=dtype)(inputs)
    b = L.Conv2D(5, 1, dtype=dtype)(inputs)
    joined = L.Concatenate(dtype=dtype)([a, inputs, b])
    x = L.Conv2D(4, (5, 3), padding="same", dilation_rate=(2, 1), dtype=dtype)(joined)
    x = L.BatchNormalization(dtype=dtype)(x)
    y = L.Conv2D(2, 1, dtype=dtype)(joined)
    return keras.Model(inputs, L.Concatenate(dtype=dtype)([L.ReLU(dtype=dtype)(x), y]))


@pytest.mark.parametrize("build", ["unet3d", "dilated"])
def test_float64_step_is_the_plain_one(build, spy):
    """Over parts and in windows (slab_bytes of a few KiB), the wrapped step is the plain one to float64
    rounding: loss, outputs, every gradient and the BatchNorm statistics."""
    previous, policy = jax.config.jax_enable_x64, keras.config.dtype_policy()
    jax.config.update("jax_enable_x64", True)
    try:
        if build == "unet3d":
            keras.config.set_dtype_policy("float64")
            keras.utils.set_random_seed(0)
            model = unet((8, 8, 8, 1), 4, levels=2)
            x = np.random.default_rng(0).random((2, 8, 8, 8, 1))
        else:
            model = _dilated_model("float64")
            x = np.random.default_rng(0).random((2, 12, 10, 2))
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="1KiB")
        assert_matches(model, wrapped, x, tol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)
        keras.config.set_dtype_policy(policy)
    assert spy["parts"] >= 2 and spy["windows"] >= 8 and spy["backward"] >= 2, spy
    if build == "unet3d":  # (its up-sampling: Conv3DTranspose(k=2, strides=2) from 2x2x2 and 4x4x4 inputs)
        assert spy["transposed"] >= 4, spy
        # its two skips parked on host after their pooling, and read from there by the decoder (``parking``)
        assert spy["parked"] >= 2 and spy["host_parts"] >= 2, spy


def test_switched_off_nothing_is_rewritten(spy, monkeypatch):
    """The control: without the rewrites the same wrapped step convolves the concatenation whole."""
    monkeypatch.setattr(convolutions, "SPLIT_PARTS", False)
    monkeypatch.setattr(convolutions, "WINDOWED", False)
    model = _dilated_model("float32")
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="1KiB")
    assert_matches(model, wrapped, np.random.default_rng(0).random((2, 12, 10, 2)).astype("float32"), tol=1e-5)
    assert spy == {"parts": 0, "windows": 0, "backward": 0, "transposed": 0, "parked": 0, "host_parts": 0}


def test_mixed_float16_matches_the_plain_step(spy):
    """Under mixed_float16 the parts and windows are float16 and the kernel slices cast as Keras casts the kernel:
    the step matches the plain float16 step as closely as the zoo's mixed-precision cases do."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = unet((8, 8, 8, 1), 4, levels=2)
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="1KiB")
        # (measured 4.6e-3; 5.6e-2 when the parts' partial outputs were rounded to float16 each)
        assert_matches(model, wrapped, np.random.default_rng(0).random((2, 8, 8, 8, 1)).astype("float32"),
                       tol=2e-2)
    finally:
        keras.config.set_dtype_policy(previous)
    assert spy["parts"] >= 2 and spy["windows"] >= 8 and spy["backward"] >= 2, spy


def test_only_linear_same_stride_one_convolutions_are_windowed():
    """A strided, "valid", even-kernel or activated convolution's forward runs whole: its rows do not read a fixed
    halo, or its pullback keeps its output (an activated call), which a windowed forward would not build."""
    x = np.zeros((1, 64, 8, 4), "float32")
    cases = {
        L.Conv2D(4, 3, padding="same"): 64,
        L.Conv2D(4, 3, padding="same", strides=2): 1,
        L.Conv2D(4, 3, padding="valid"): 1,
        L.Conv2D(4, 2, padding="same"): 1,
        L.Conv2D(4, 3, padding="same", activation="relu"): 1,
        L.Conv2DTranspose(4, 3, padding="same"): 1,
    }
    for layer, expected in cases.items():
        assert convolutions.window_count(layer, [x], slab_bytes=64) == expected, layer.get_config()
    assert convolutions.window_count(L.Conv2D(4, 3, padding="same"), [x], slab_bytes=0) == 1  # slabs off
