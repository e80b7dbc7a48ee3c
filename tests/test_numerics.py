"""Wrapped vs plain on the same weights and seeds: loss, every gradient, BatchNorm statistics, Dropout masks."""

import numpy as np
import pytest
import tensorflow as tf

import keras_lms
from tests import models
from tests.oracle import assert_matches, restore, snapshot

RNG = np.random.default_rng(0)


CASES = {**models.ORACLE_CASES,
         "tied_weights": (models.tied_weights, lambda: RNG.random((4, 6)).astype("float32"))}
images = models.images


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("settings", [dict(min_bytes=0, keep_last=0, prefetch=0), dict(min_bytes=0, prefetch=2),
                                      dict()], ids=["all-prefetch0", "keep1-prefetch2", "defaults"])
def test_wrapped_step_matches_plain(name, settings):
    build, data = CASES[name]
    model = build()
    wrapped = keras_lms.wrap(model, **settings)
    assert_matches(model, wrapped, data())
    if settings.get("min_bytes") == 0:
        assert any(e.offloaded for e in wrapped.lms_plan)


@pytest.mark.parametrize("name", ["cnn_bn_dropout", "nested", "subclassed", "tied_weights", "composite_nested"])
def test_eager_step_matches_plain(name):
    build, data = CASES[name]
    model = build()
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0), data(), graph=False)


def test_state_updates_happen_once_per_step():
    """BatchNorm moving stats and Dropout seed states advance exactly as in the plain model (not twice)."""
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    from tests.oracle import compare_step

    result = compare_step(model, wrapped, images())
    changed = result["state_changed"]
    assert any("moving_mean" in p for p in changed) and any("seed_generator" in p for p in changed)
    assert max(result["state"].values()) == 0.0


def test_dropout_masks_identical_in_forward_and_backward():
    """A dropout-only model: the gradient wrt the input is the mask / (1 - rate); it must equal the plain one."""
    import keras

    inp = keras.Input((64,))
    model = keras.Model(inp, keras.layers.Dropout(0.5)(keras.layers.Dense(64)(inp)))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x = tf.constant(RNG.random((8, 64)).astype("float32"))
    start = snapshot(model)

    def input_grad(m):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = m(x, training=True)
        return out, tape.gradient(out, x)

    out_p, g_p = tf.function(lambda: input_grad(model))()
    restore(model, start)
    out_w, g_w = tf.function(lambda: input_grad(wrapped))()
    np.testing.assert_array_equal(out_p.numpy() == 0, out_w.numpy() == 0)
    np.testing.assert_allclose(g_w.numpy(), g_p.numpy(), rtol=1e-6)


def test_mixed_precision(mixed_precision):
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    assert_matches(model, wrapped, images(size=32, channels=1), tol=1e-3)
    dtypes = {d for e in wrapped.lms_plan if e.offloaded for d in e.dtypes}
    assert "float16" in dtypes  # activations go to host in their own dtype


def test_mixed_precision_host_copies_are_float16(mixed_precision):
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x = images()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(wrapped(x, training=True), "float32"))
        return tape.gradient(loss, wrapped.trainable_variables)

    graph = step.get_concrete_function().graph
    swap_outs = [op for op in graph.get_operations() if op.name.rsplit("/", 1)[-1].startswith("lms_swap_out")]
    assert swap_outs
    assert {op.outputs[0].dtype for op in swap_outs[1:]} == {tf.float16}
