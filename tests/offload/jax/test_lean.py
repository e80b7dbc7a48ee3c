"""`keras_lms.offload.jax.lean`: the lean backward rules give JAX's own gradients (JAX CPU, float32): the block
max pooling exactly, ties included; the block transposed convolution to float32 summation order. Layers outside
their conditions get no lean rule."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_lms.offload.jax import lean  # noqa: E402
from keras_lms.offload.jax.lean import lean_pullback_for  # noqa: E402

pytestmark = pytest.mark.jax


def _recording(bounds, counts):
    """``row_windows.bounds`` that records each call's window count (how many windows a rule ran in)."""
    def recording(rows, windows):
        counts.append(windows)
        return bounds(rows, windows)
    return recording


def _compare(layer, x, slab_bytes=0):
    layer(x)
    trainable = [v.value for v in layer.trainable_variables]
    y, pullback = jax.vjp(lambda t, a: layer.stateless_call(t, [], a[0])[0], trainable, [jnp.asarray(x)])
    cotangent = jnp.asarray(np.random.default_rng(1).uniform(size=y.shape).astype("float32"))
    lean = lean_pullback_for(layer, trainable, [x], slab_bytes=slab_bytes)
    assert lean is not None
    return jax.tree.leaves(pullback(cotangent)), jax.tree.leaves(lean(trainable, [jnp.asarray(x)])(cotangent))


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_block_max_pooling_gradient_is_exact_with_ties(nd):
    pool = [None, keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D][nd]()
    x = np.random.default_rng(0).uniform(size=(2, *(8,) * nd, 3)).astype("float32")
    x = np.maximum(x - 0.5, 0.0)  # ReLU-like: many windows all zero, many ties
    x[0, ..., 0] = 0.0
    ref, got = _compare(pool, x)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize("windowed", [False, True], ids=["whole", "windows"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_block_transposed_convolution_gradients(nd, windowed, monkeypatch):
    """Windowed: ``slab_bytes`` of 1 gives one window per input row (4 here), each reading its 2 cotangent rows."""
    keras.utils.set_random_seed(0)
    layer = [None, keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
             keras.layers.Conv3DTranspose][nd](5, 2, strides=2, padding="same")
    x = np.random.default_rng(0).uniform(size=(2, *(4,) * nd, 3)).astype("float32")
    windows = []
    monkeypatch.setattr(lean.row_windows, "bounds", _recording(lean.row_windows.bounds, windows))
    ref, got = _compare(layer, x, slab_bytes=1 if windowed else 0)
    assert windows == ([4] if windowed else []), windows
    for a, b in zip(ref, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [
    keras.layers.MaxPooling2D(3, strides=2), keras.layers.MaxPooling2D(2, padding="same"),
    keras.layers.Conv2DTranspose(4, 3, strides=2), keras.layers.Conv2DTranspose(4, 2, strides=2, activation="relu"),
    keras.layers.Conv2D(4, 2),
], ids=["overlapping-pool", "same-pool", "overlapping-transpose", "transpose-with-activation", "conv"])
def test_no_lean_rule_outside_its_conditions(layer):
    x = np.zeros((1, 8, 8, 2), "float32")
    layer(x)
    assert lean_pullback_for(layer, [v.value for v in layer.trainable_variables], [x]) is None
