"""Fails loudly when a Keras release changes what keras_lms/_keras_adapter.py relies on."""

import pathlib
import re

import keras
import numpy as np
import pytest

from keras_lms import _keras_adapter as adapter


def test_installed_keras_is_supported_and_pinned():
    adapter.check_keras_version()
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"keras(>=[^"]+)"', pyproject).group(1)
    assert pin == ",".join(adapter.SUPPORTED_KERAS), "pyproject's Keras pin and the adapter disagree"
    with pytest.raises(ImportError, match="supports Keras"):
        adapter.check_keras_version("3.16.0")
    with pytest.raises(ImportError, match="supports Keras"):
        adapter.check_keras_version("3.14.2")


def test_layer_call_is_looked_up_on_the_instance():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    seen = []

    def make(op, original):
        def wrapper(*args, **kwargs):
            seen.append(kwargs.get("training", "absent"))
            return original(*args, **kwargs)
        return wrapper

    x = np.ones((1, 3), "float32")
    with adapter.patched_calls([layer], make):
        layer(x)
    layer(x)
    assert len(seen) == 1
    assert "call" not in layer.__dict__ and "_keras_lms_original_call" not in layer.__dict__


def test_training_is_resolved_before_call():
    layer = keras.layers.Dropout(0.5)
    seen = []

    def make(op, original):
        def wrapper(*args, **kwargs):
            seen.append(kwargs.get("training"))
            return original(*args, **kwargs)
        return wrapper

    inp = keras.Input((4,))
    model = keras.Model(inp, layer(inp))
    with adapter.patched_calls([layer], make):
        model(np.ones((2, 4), "float32"), training=True)
    assert seen == [True]


def test_run_stateless_collects_call_losses_only_and_assigns_nothing():
    class AddsLoss(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones", regularizer=keras.regularizers.L2(1.0))
            self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            self.count.assign(self.count + 1)
            return x * self.w

    layer = AddsLoss()
    layer.build((None, 3))
    x = keras.ops.ones((1, 3))
    out, new_state, losses = adapter.run_stateless(layer, layer.call, [keras.ops.full((3,), 2.0)],
                                                   [keras.ops.zeros(())], (x,), {})
    np.testing.assert_allclose(np.asarray(out), 2.0)
    assert len(losses) == 1 and float(losses[0]) == 3.0  # not the weight regulariser
    assert float(new_state[0]) == 1.0 and float(layer.count.numpy()) == 0.0


def test_autocast_and_loss_helpers_exist():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        seen = []

        def make(op, original):
            def wrapper(*args, **kwargs):
                seen.append(adapter.current_autocast_dtype())
                return original(*args, **kwargs)
            return wrapper

        with adapter.patched_calls([layer], make):
            layer(np.ones((1, 3), "float32"))
        assert seen == ["float16"]
        assert adapter.raw_values([layer.kernel])[0].dtype == "float32"
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert adapter.current_autocast_dtype() is None
    inp = keras.Input((2,))
    model = keras.Model(inp, keras.ops.exp(keras.layers.Dense(2)(inp)))
    ops = adapter.functional_operations(model)
    assert len(ops) == 2 and not any(isinstance(op, keras.layers.InputLayer) for op in ops)
    adapter.clear_losses(model)
    assert adapter.functional_operations(keras.Sequential([keras.layers.Dense(1)])) is None


def test_quantized_layers_are_detected():
    layer = keras.layers.Dense(4)
    layer.build((None, 4))
    assert not adapter.is_quantized(layer)
    layer.quantize("int8")
    assert adapter.is_quantized(layer)


def test_releasing_graph_runs_gives_identical_results():
    """The adapter's copy of Functional._run_through_graph (used by the torch back end) matches Keras'."""
    from tests import models

    model = models.multi_io()
    rng = np.random.default_rng(0)
    x = {"image": rng.random((2, 16, 16, 3)).astype("float32"), "meta": rng.random((2, 5)).astype("float32")}
    expected = model(x, training=False)
    with adapter.releasing_graph_runs([model]):
        got = model(x, training=False)
    for key in expected:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(expected[key]))
    assert "_run_through_graph" not in model.__dict__


class _DropoutBlock(keras.layers.Layer):
    """A composite layer whose ``call`` has no ``training``: its Dropout learns the flag from the call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = keras.layers.Dropout(0.5, seed=1)

    def call(self, x):
        return self.drop(x)


def _bound_call_of(model, layer, x, training):
    """The ``CallInContext`` that patched_calls hands make_wrapper when ``model`` calls ``layer``."""
    bound = []

    def make(op, original):
        bound.append(original)
        return original

    with adapter.patched_calls([layer], make):
        model(x, training=training)
    return bound[0]


def test_layer_call_stores_resolved_training_in_the_thread_local_call_context():
    """Layer.__call__ puts the resolved ``training`` into global_state's ``current_call_ctx`` (a CallContext)
    before ``call`` runs, and a sublayer without an explicit ``training`` reads it from there."""
    block = _DropoutBlock()
    inp = keras.Input((64,))
    model = keras.Model(inp, block(inp))
    x = np.ones((4, 64), "float32")
    bound = _bound_call_of(model, block, x, training=True)
    assert isinstance(bound, adapter.CallInContext)
    assert bound.values == {"training": True}
    assert _bound_call_of(model, block, x, training=False).values == {"training": False}
    from keras.src.backend.common import global_state

    assert global_state.get_global_attribute("current_call_ctx") is None  # reset after the outer call


def test_call_in_context_replays_training_outside_layer_call():
    """The recompute calls ``call`` outside Layer.__call__: without the replay the inner Dropout is inactive."""
    from keras.src.backend.common import global_state

    block = _DropoutBlock()
    inp = keras.Input((64,))
    model = keras.Model(inp, block(inp))
    x = keras.ops.ones((4, 64))
    bound = _bound_call_of(model, block, x, training=True)
    np.testing.assert_array_equal(np.asarray(block.call(x)), 1.0)  # no context: inference mode
    dropped = np.asarray(bound(x))
    assert 0.2 < float(np.mean(dropped == 0)) < 0.8  # training mode: about half dropped
    assert global_state.get_global_attribute("current_call_ctx") is None  # restored


def test_call_in_context_runs_the_forward_in_the_live_context():
    """Inside the context it recorded (the forward), it runs there: a sublayer's explicit ``training=False``
    overwrites the shared context for the calls after it, as in the plain model (Keras' own behaviour)."""
    from keras.src.backend.common import global_state

    class Explicit(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x, training=False)

    layer = Explicit()
    seen = []

    def make(op, original):
        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            seen.append((original.values["training"], global_state.get_global_attribute("current_call_ctx").training))
            return out
        return wrapper

    inp = keras.Input((3,))
    model = keras.Model(inp, layer(inp))
    with adapter.patched_calls([layer], make):
        model(np.ones((2, 3), "float32"), training=True)
    assert seen == [(True, False)]  # recorded True; the live context now holds the sublayer's False


def test_call_in_context_replays_on_another_thread():
    """Keras' call context is thread-local (torch runs backward passes on its own threads): the replay enters
    it on whichever thread calls."""
    import threading

    block = _DropoutBlock()
    inp = keras.Input((64,))
    model = keras.Model(inp, block(inp))
    x = keras.ops.ones((4, 64))
    bound = _bound_call_of(model, block, x, training=True)
    out = []
    thread = threading.Thread(target=lambda: out.append(np.asarray(bound(x))))
    thread.start()
    thread.join()
    assert 0.2 < float(np.mean(out[0] == 0)) < 0.8
