"""``keras_lms.wrap`` on the JAX back end (numerics on the JAX CPU back end; what the offload does to memory is
checked in the compiled H100 program, test_compiled_offload.py)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_lms  # noqa: E402
from keras_lms import offload  # noqa: E402
from tests.oracle import assert_matches  # noqa: E402

pytestmark = pytest.mark.jax

L = keras.layers


def _small_model(dtype="float32"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3), dtype=dtype)
    x = L.Conv2D(8, 3, padding="same", dtype=dtype)(inputs)
    x = L.BatchNormalization(dtype=dtype)(x)
    x = L.ReLU(6.0, dtype=dtype)(x)
    x = L.DepthwiseConv2D(3, padding="same", dtype=dtype)(x)
    x = L.Dropout(0.3, seed=4, dtype=dtype)(x)
    x = L.Conv2D(8, 3, padding="same", dtype=dtype)(x)
    x = L.GlobalAveragePooling2D(dtype=dtype)(x)
    return keras.Model(inputs, L.Dense(5, activation="softmax", dtype=dtype)(x))


def test_jax_is_a_registered_back_end():
    backend = offload.active_backend()
    assert backend.__name__ == "keras_lms.offload.jax"
    assert offload.contract_problems(backend) == []


def test_float64_step_is_exact():
    """Where XLA's reordering is not amplified, the wrapped step is the plain one to float64 rounding (measured
    1.6e-16): the offload changes where residuals live, not what is computed."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        model = _small_model("float64")
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
        x = np.random.default_rng(0).random((2, 16, 16, 3))
        assert_matches(model, wrapped, x, tol=1e-12)
        assert all(entry.offloaded for entry in wrapped.lms_plan)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_fit_trains_like_the_plain_model():
    """``fit`` (Keras' jitted JAX trainer, its variables purged while the loop holds the state) plans inside the
    traced step and trains to the plain model's losses and weights."""
    x = np.random.default_rng(1).random((8, 16, 16, 3)).astype("float32")
    y = keras.utils.to_categorical(np.arange(8) % 5, 5)
    results = []
    for wrap in (False, True):
        model = _small_model()
        trained = keras_lms.wrap(model, min_bytes=0, keep_last=0) if wrap else model
        trained.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy")
        history = trained.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], [np.asarray(v.value) for v in model.variables]))
        if wrap:
            assert trained.jit_compile is True
            assert sum(entry.offloaded for entry in trained.lms_plan) >= 5
    (plain_loss, plain_vars), (wrapped_loss, wrapped_vars) = results
    np.testing.assert_allclose(wrapped_loss, plain_loss, rtol=1e-6)
    for a, b in zip(plain_vars, wrapped_vars):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_loss_added_inside_call_is_differentiated():
    """A layer whose ``call`` adds a loss: the loss is an output of the offloaded call, so it reaches
    ``model.losses`` and its gradient flows (it would otherwise leak a tracer out of the custom_vjp)."""

    class Penalised(L.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 4), initializer="glorot_uniform")

        def call(self, x):
            y = keras.ops.matmul(x, self.kernel)
            self.add_loss(0.1 * keras.ops.mean(keras.ops.square(y)))
            return y

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, L.Dense(2)(Penalised()(inputs)))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    result = assert_matches(model, wrapped, np.random.default_rng(0).random((4, 6)).astype("float32"))
    assert result["n_grads"] == 3  # the penalised kernel, the dense kernel and bias
    assert wrapped.lms_plan[0].offloaded


def _residual_model(activation: bool):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3), dtype="float64")
    x = L.Conv2D(8, 3, padding="same", dtype="float64")(inputs)
    y = L.BatchNormalization(dtype="float64")(L.Conv2D(8, 1, dtype="float64")(x))
    if activation:
        y = L.ReLU(dtype="float64")(y)
    x = L.Conv2D(8, 3, padding="same", dtype="float64")(L.Add(dtype="float64")([x, y]))
    return keras.Model(inputs, L.Dense(5, dtype="float64")(L.GlobalAveragePooling2D(dtype="float64")(x)))


@pytest.mark.parametrize("activation,tol", [(True, 1e-12), (False, 1e-6)], ids=["relu_after_bn", "linear_path"])
def test_a_batchnorm_on_a_linear_path_amplifies_reordering(activation, tol):
    """Where the zoo's tolerance comes from (tests/test_applications.py, ``JAX_TOLERANCE``): in float64 a
    BatchNorm followed by a ReLU is exact to rounding; on a linear path to the global pooling its input gradient
    is a cancellation, and XLA's other summation order shows (measured 7.3e-8)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        model = _residual_model(activation)
        wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
        assert_matches(model, wrapped, np.random.default_rng(0).random((2, 16, 16, 3)), tol=tol)
    finally:
        jax.config.update("jax_enable_x64", previous)
