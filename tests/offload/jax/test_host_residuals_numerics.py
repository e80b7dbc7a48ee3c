"""`keras_lms.offload.jax.host_residuals` changes where residuals live, not what a step computes: on the JAX CPU
back end (float32) the loss, the predictions, BatchNorm's moving statistics and the seed state after a step are
bit-identical to the plain step's, and the gradients equal them to float32 summation order (rtol 1e-5: the
optimisation barriers change how XLA fuses the backward's reductions, and the lean transposed-convolution
backward sums in another order; measured at most ~2e-5 relative on elements near 1e-9 absolute). CPU lowers the
copies to host to identities, so these check numerics only; what the copies do to memory is checked on the compiled
H100 program (test_compiled_offload.py)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_lms import _keras_adapter as adapter  # noqa: E402
from keras_lms.offload.jax import host_residuals  # noqa: E402

pytestmark = pytest.mark.jax


def _model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.5, name="bn1")(x)
    skip = keras.layers.ReLU(name="relu1")(x)
    x = keras.layers.MaxPooling2D(name="pool")(skip)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.Dropout(0.3, seed=7, name="dropout")(x)
    x = keras.layers.Conv2DTranspose(8, 2, strides=2, padding="same", name="up")(x)
    x = keras.layers.Concatenate(name="concat")([x, skip])
    outputs = keras.layers.Conv2D(1, 1, activation="sigmoid", name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


def _grads_and_state(offload: bool, without=()):
    """(loss, y_pred, gradients, non-trainable values after the step) of one training forward/backward."""
    model = _model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16, 16, 3)).astype("float32")
    y = rng.uniform(size=(4, 16, 16, 1)).astype("float32")
    adapter.build_compiled_metrics(model, (x, y))
    model.optimizer.build(model.trainable_variables)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)
              and layer.name not in without]

    def grads(trainable, non_trainable, metrics, optimizer, x, y):
        fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (loss, (_, y_pred, non_trainable, _)), g = fn(trainable, non_trainable, metrics, x, y, None, training=True,
                                                      optimizer_variables=optimizer)
        return loss, y_pred, g, non_trainable

    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in model.metrics_variables], [v.value for v in model.optimizer.variables])
    record = []
    if offload:
        with host_residuals.host_residuals(layers, min_bytes=1024, record=record):
            out = jax.jit(grads)(*state, x, y)
        assert record, "nothing was offloaded: the test model is too small for min_bytes"
    else:
        out = jax.jit(grads)(*state, x, y)
    return jax.tree.map(np.asarray, out), [v.path for v in model.non_trainable_variables]


def test_loss_predictions_state_and_gradients_equal_the_plain_step():
    (loss, y_pred, grads, state), names = _grads_and_state(offload=False)
    (loss_w, y_pred_w, grads_w, state_w), _ = _grads_and_state(offload=True)
    np.testing.assert_array_equal(loss_w, loss)
    np.testing.assert_array_equal(y_pred_w, y_pred)
    assert any("moving_mean" in n for n in names) and any("seed" in n for n in names)
    for name, a, b in zip(names, state_w, state):
        np.testing.assert_array_equal(a, b, err_msg=name)  # BatchNorm statistics and the Dropout seed state
    for a, b in zip(grads_w, grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_runs_and_matches(policy):
    """Under a mixed policy the layers autocast inside the offloaded call (kernels cast in the pullback); the
    step matches the plain one to the compute dtype's precision."""
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        (loss, y_pred, grads, state), names = _grads_and_state(offload=False)
        (loss_w, y_pred_w, grads_w, state_w), _ = _grads_and_state(offload=True)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    np.testing.assert_allclose(loss_w, loss, rtol=1e-3)
    np.testing.assert_allclose(y_pred_w.astype("float32"), y_pred.astype("float32"), rtol=1e-2, atol=1e-2)
    for name, a, b in zip(names, state_w, state):
        np.testing.assert_allclose(np.asarray(a, "float64"), np.asarray(b, "float64"), rtol=1e-2, atol=1e-3,
                                   err_msg=name)
    # atol relative to the gradients' scale (mixed_float16's are loss-scaled, by 2**15): conv1's bias, followed by
    # BatchNorm, has a gradient that is mathematically zero, float16 rounding noise (|g| ~1.5e-4 of the global norm)
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, "float64"))) for g in grads)))
    for a, b in zip(grads_w, grads):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a.astype("float32"), b.astype("float32"), rtol=5e-2, atol=max(1e-3, 1e-4 * total))


def test_the_naive_checkpoint_offload_is_numerically_plain_too():
    """The negative control of the compiled-memory tests fails on memory, not on numerics."""
    model = _model()
    x = np.ones((2, 16, 16, 3), "float32")
    plain = np.asarray(model(x, training=False))
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    with host_residuals.checkpoint_offloading(layers, min_bytes=1024):
        out, _ = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False))(tv, ntv, x)
    np.testing.assert_allclose(np.asarray(out), plain, rtol=1e-6, atol=1e-6)
