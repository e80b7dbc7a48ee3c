"""Fails loudly when a Keras release changes what keras_lms/_keras_adapter/ relies on."""

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
        assert keras.backend.standardize_dtype(adapter.raw_values([layer.kernel])[0].dtype) == "float32"
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
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got[key]), keras.ops.convert_to_numpy(expected[key]))
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


# ------------------------------------------------------------------ canaries for the private attributes
def canary(ok, function: str, assumption: str) -> None:
    """Fail naming the Keras version and the adapter function whose assumption no longer holds."""
    assert ok, (f"Keras {keras.__version__} changed what keras_lms._keras_adapter.{function}() relies on (written for "
                f"Keras {','.join(adapter.SUPPORTED_KERAS)}): {assumption}")


def gone(function: str):
    """The error an adapter function raises when the private attribute it reads is missing (negative control)."""
    return pytest.raises(RuntimeError, match=rf"_keras_adapter\.{function}\(\).*Keras >=3\.15,<3\.16")


def test_stateless_scope_is_the_public_name():
    canary(adapter.StatelessScope is keras.StatelessScope, "run_stateless", "keras.StatelessScope is public")


def test_optimizer_variable_key_is_the_key_keras_indexes_state_by():
    opt = keras.optimizers.SGD(0.1)
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.zeros(3, "float32"))
    opt.build([a, b])
    keys = [adapter.optimizer_variable_key(opt, v) for v in (a, b)]
    canary(len(set(keys)) == 2 and keys == [adapter.optimizer_variable_key(opt, v) for v in (a, b)],
           "optimizer_variable_key", "Optimizer._var_key gives each variable one stable key")
    if keras.backend.backend() == "tensorflow":
        canary(adapter.optimizer_variable_key(opt, a.value) == keys[0], "optimizer_variable_key",
               "a keras.Variable and the tf.Variable it wraps have the same _var_key")
    with gone("optimizer_variable_key"):
        adapter.optimizer_variable_key(object(), a)


def test_optimizer_trainable_variables_are_what_apply_without_variables_updates():
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))
    for opt in (keras.optimizers.SGD(0.5), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5))):
        opt.build([a, b])
        got = adapter.optimizer_trainable_variables(opt)
        canary(len(got) == 2 and got[0] is a and got[1] is b, "optimizer_trainable_variables",
               f"{type(opt).__name__}._trainable_variables is the list build() was given")
    opt = keras.optimizers.SGD(0.5)
    opt.build([a, b])
    opt.apply([keras.ops.ones(2), keras.ops.ones(3)])  # no variables: Keras applies to that list
    np.testing.assert_allclose(np.asarray(a.numpy()), 0.5)
    with gone("optimizer_trainable_variables"):
        adapter.optimizer_trainable_variables(object())


def test_rmsprop_momentums_are_the_momentum_buffers_the_update_writes():
    v = keras.Variable(np.ones(3, "float32"))
    opt = keras.optimizers.RMSprop(0.1, momentum=0.9)
    opt.build([v])
    (m,) = adapter.rmsprop_momentums(opt)
    canary(tuple(m.shape) == (3,) and any(m is w for w in opt.variables) and not np.any(np.asarray(m.numpy())),
           "rmsprop_momentums", "RMSprop._momentums holds one zero-initialised optimizer variable per variable")
    opt.apply([keras.ops.ones(3)], [v])
    canary(np.all(np.asarray(m.numpy()) > 0), "rmsprop_momentums", "RMSprop's update writes RMSprop._momentums")
    without = keras.optimizers.RMSprop(0.1)
    without.build([v])
    assert adapter.rmsprop_momentums(without) == []
    with gone("rmsprop_momentums"):
        adapter.rmsprop_momentums(keras.optimizers.RMSprop(0.1, momentum=0.9))  # not built: no buffers yet


def test_serialize_like_saves_a_subclass_as_its_base(monkeypatch):
    base = keras.optimizers.SGD
    sub = type("SGD", (base,), {"__module__": __name__})
    expected = {"module": "keras.optimizers", "class_name": "SGD", "registered_name": None,
                "config": base(0.1, name="opt").get_config()}
    assert keras.saving.serialize_keras_object(sub(0.1))["module"] == __name__  # negative control: not aliased
    adapter.serialize_like(sub, base)
    canary(keras.saving.serialize_keras_object(sub(0.1, name="opt")) == expected, "serialize_like",
           "serialize_keras_object names a class by keras.src.api_export.REGISTERED_OBJS_TO_NAMES")

    @keras.saving.register_keras_serializable("keras_lms_canary")
    class Custom(keras.optimizers.SGD):
        pass

    custom_sub = type("Custom", (Custom,), {"__module__": __name__})
    assert keras.saving.serialize_keras_object(custom_sub(0.1))["registered_name"] == "Custom"
    adapter.serialize_like(custom_sub, Custom)
    saved = keras.saving.serialize_keras_object(custom_sub(0.1))
    canary(saved["registered_name"] == "keras_lms_canary>Custom", "serialize_like",
           "serialize_keras_object names a custom class by keras.saving.get_registered_name")
    assert keras.saving.get_registered_object("keras_lms_canary>Custom") is Custom
    assert type(keras.saving.deserialize_keras_object(saved)) is Custom

    from keras.src import api_export

    monkeypatch.delattr(api_export, "REGISTERED_OBJS_TO_NAMES")
    with gone("serialize_like"):
        adapter.serialize_like(sub, base)


@pytest.mark.parametrize("axis,shape", [(-1, (2, 4, 4, 3)), (1, (2, 3, 4, 4)), (1, (4, 5, 3))])
def test_batchnorm_reduction_axes_are_the_axes_moments_reduces(axis, shape):
    layer = keras.layers.BatchNormalization(axis=axis)
    layer.build(shape)
    hook = adapter.batchnorm_moments_hook(layer)
    assert hook is not None
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).random(shape).astype("float32"))

    def same(a, b):
        a, b = [keras.ops.convert_to_numpy(t) for t in a], [keras.ops.convert_to_numpy(t) for t in b]
        return all(u.shape == v.shape and np.allclose(u, v, atol=1e-6) for u, v in zip(a, b))

    keras_moments = getattr(layer, hook)(x, None)
    canary(same(keras_moments, keras.ops.moments(x, adapter.batchnorm_reduction_axes(layer, x))),
           "batchnorm_reduction_axes", f"BatchNormalization.{hook} reduces over every axis but `axis`")
    assert not same(keras_moments, keras.ops.moments(x, list(range(1, len(shape)))))  # negative control


_KERNEL_LAYERS = {  # name: (constructor with a relu activation, input shape)
    "Dense": (lambda: keras.layers.Dense(3, activation="relu"), (2, 4)),
    "EinsumDense": (lambda: keras.layers.EinsumDense("ab,bc->ac", 3, activation="relu"), (2, 4)),
    "Conv1D": (lambda: keras.layers.Conv1D(3, 2, activation="relu"), (2, 5, 2)),
    "Conv2D": (lambda: keras.layers.Conv2D(3, 2, activation="relu"), (2, 5, 5, 2)),
    "Conv3D": (lambda: keras.layers.Conv3D(3, 2, activation="relu"), (2, 4, 4, 4, 2)),
    "Conv1DTranspose": (lambda: keras.layers.Conv1DTranspose(3, 2, activation="relu"), (2, 5, 2)),
    "Conv2DTranspose": (lambda: keras.layers.Conv2DTranspose(3, 2, activation="relu"), (2, 5, 5, 2)),
    "Conv3DTranspose": (lambda: keras.layers.Conv3DTranspose(3, 2, activation="relu"), (2, 4, 4, 4, 2)),
    "DepthwiseConv1D": (lambda: keras.layers.DepthwiseConv1D(2, activation="relu"), (2, 5, 2)),
    "DepthwiseConv2D": (lambda: keras.layers.DepthwiseConv2D(2, activation="relu"), (2, 5, 5, 2)),
    "SeparableConv1D": (lambda: keras.layers.SeparableConv1D(3, 2, activation="relu"), (2, 5, 2)),
    "SeparableConv2D": (lambda: keras.layers.SeparableConv2D(3, 2, activation="relu"), (2, 5, 5, 2)),
}


def test_the_kernel_layer_table_is_covered():
    from keras_lms.planning import layer_facts

    assert set(_KERNEL_LAYERS) == set(layer_facts.KERNEL_LAYERS)


@pytest.mark.parametrize("name", sorted(_KERNEL_LAYERS))
def test_fused_activation_is_stored_on_the_instance_and_applied_last(name):
    make, shape = _KERNEL_LAYERS[name]
    layer = make()
    layer.build(shape)
    rng = np.random.default_rng(1)
    layer.set_weights([rng.standard_normal(w.shape).astype("float32") for w in layer.get_weights()])
    x = keras.ops.convert_to_tensor(rng.standard_normal(shape).astype("float32"))
    out = keras.ops.convert_to_numpy(layer(x))
    canary(adapter.fused_activation(layer) is keras.activations.relu, "fused_activation",
           f"{name} stores `activation` on the instance")
    with adapter.patched_attribute(layer, "activation", keras.activations.linear):
        pre = keras.ops.convert_to_numpy(layer(x))
    canary(np.any(pre < 0) and np.allclose(np.maximum(pre, 0), out, atol=1e-6), "fused_activation",
           f"{name}.call reads self.activation at call time and applies it last")
    assert adapter.fused_activation(layer) is keras.activations.relu  # restored


def test_fused_activation_refuses_an_activation_not_stored_on_the_instance():
    class PropertyActivation(keras.layers.Dense):
        activation = property(lambda self: keras.activations.relu, lambda self, value: None)

    with pytest.raises(RuntimeError, match=r"_keras_adapter\.fused_activation\(\).*Keras >=3\.15,<3\.16"):
        adapter.fused_activation(PropertyActivation(2))


@pytest.mark.parametrize("make, shape", [(lambda: keras.layers.Conv2D(3, 3, padding="same"), (2, 6, 5, 2)),
                                         (lambda: keras.layers.Conv3D(2, 3, padding="same"), (1, 5, 4, 6, 2))])
def test_valid_convolution_makes_the_layers_own_call_unpadded(make, shape):
    layer = make()
    x = keras.ops.convert_to_tensor(np.random.default_rng(3).standard_normal(shape).astype("float32"))
    same = keras.ops.convert_to_numpy(layer(x))
    with adapter.valid_convolution(layer):
        valid = keras.ops.convert_to_numpy(layer(x))
    canary(valid.shape[1:-1] == tuple(d - 2 for d in shape[1:-1]), "valid_convolution",
           "BaseConv.convolution_op reads self.padding at call time")
    interior = (slice(None),) + (slice(1, -1),) * (len(shape) - 2)
    canary(np.allclose(same[interior], valid, atol=1e-5), "valid_convolution",
           "the unpadded call is the padded one's interior")
    assert layer.padding == "same" and keras.ops.convert_to_numpy(layer(x)).shape == same.shape  # restored


def test_valid_convolution_refuses_padding_not_stored_on_the_instance():
    class PropertyPadding(keras.layers.Conv2D):
        padding = property(lambda self: "same", lambda self, value: None)

    with pytest.raises(RuntimeError, match=r"_keras_adapter\.valid_convolution\(\).*Keras >=3\.15,<3\.16"):
        with adapter.valid_convolution(PropertyPadding(2, 3)):
            pass


def test_replaced_convolution_runs_the_layers_own_bias_and_activation_around_it():
    """The JAX back end's convolution over a concatenation's parts and windowed forward replace only the
    convolution: ``BaseConv.call`` must read ``self.convolution_op`` at call time and add the bias and apply the
    activation to what it returns."""
    layer = keras.layers.Conv2D(3, 3, padding="same", activation="relu")
    x = keras.ops.convert_to_tensor(np.random.default_rng(4).standard_normal((2, 5, 4, 2)).astype("float32"))
    plain = keras.ops.convert_to_numpy(layer(x))
    layer.bias.assign(np.array([0.5, -1.0, 2.0], "float32"))
    seen = []

    def convolve(kernel, convolution_op):
        seen.append(tuple(kernel.shape))
        return convolution_op(x, kernel) * 0.0  # the layer's own op, zeroed: only the bias and the relu are left

    with adapter.replaced_convolution(layer, convolve):
        replaced = keras.ops.convert_to_numpy(layer(keras.ops.zeros((2, 5, 4, 2))))
    canary(seen == [(3, 3, 2, 3)], "replaced_convolution", "BaseConv.call reads self.convolution_op at call time")
    canary(np.allclose(replaced, np.broadcast_to([0.5, 0.0, 2.0], replaced.shape)), "replaced_convolution",
           "the bias and the activation are applied to the convolution op's result")
    layer.bias.assign(np.zeros(3, "float32"))
    assert np.allclose(keras.ops.convert_to_numpy(layer(x)), plain, atol=1e-6)  # restored
    with gone("replaced_convolution"):  # a layer that does not convolve through convolution_op
        with adapter.replaced_convolution(keras.layers.Dense(2), convolve):
            pass


# ---------------------------------------------------------- the fit loop, for keras_lms.BackupAndRestore
def _sgd_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def test_fit_starts_at_the_initial_epoch_a_callback_sets():
    class StartAtTwo(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            adapter.set_initial_epoch(self.model, 2)

    model = _sgd_model()
    history = model.fit(np.ones((2, 3)), np.ones((2, 1)), epochs=3, verbose=0, callbacks=[StartAtTwo()])
    canary(history.epoch == [2] and adapter.initial_epoch(model) == 2, "set_initial_epoch",
           "fit reads Trainer._initial_epoch after on_train_begin")
    adapter.set_initial_epoch(model, None)
    with gone("initial_epoch"):
        adapter.initial_epoch(object())


def test_skipping_train_function_passes_over_the_first_batches():
    """Skipping 2 of 4 batches trains exactly as fitting the last 2 does; on_done runs once, after the skips."""
    x = np.random.default_rng(0).random((8, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    done = []

    class SkipTwo(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            canary(adapter.can_skip_train_steps(self.model), "skipping_train_function",
                   "fit makes model.train_function before on_train_begin")
            self.model.train_function = adapter.skipping_train_function(self.model, 2, on_done=lambda: done.append(1))

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                assert done == [1]

    skipped = _sgd_model()
    history = skipped.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[SkipTwo()])
    tail = _sgd_model()
    tail.fit(x[4:], y[4:], batch_size=2, epochs=1, shuffle=False, verbose=0)
    canary(all(np.array_equal(a, b) for a, b in zip(skipped.get_weights(), tail.get_weights())),
           "skipping_train_function", "fit hands train_function the epoch's iterator (TensorFlow) or the batch (torch)")
    assert int(skipped.optimizer.iterations.numpy()) == 2 and np.isfinite(history.history["mae"][0])
    assert not adapter.can_skip_train_steps(_sgd_model())  # outside fit: no train function to wrap


def test_global_seed_generator_is_what_unseeded_keras_random_draws_from():
    keras.random.normal((2,))  # made on first use
    generator = adapter.global_seed_generator()
    canary(generator is not None and generator is adapter.global_seed_generator(create=True), "global_seed_generator",
           "keras.random without a seed draws from the global-state attribute global_seed_generator")
    before = keras.ops.convert_to_numpy(generator.state.value)
    keras.random.normal((2,))
    canary(not np.array_equal(before, keras.ops.convert_to_numpy(generator.state.value)), "global_seed_generator",
           "an unseeded keras.random call advances the global seed generator's state")


# ---------------------------------------------------------------- no private Keras API outside the adapter
# Private Keras names keras-lms used outside the adapter before issue 14, and the ones the adapter reads.
KERAS_PRIVATE_NAMES = frozenset({
    "_var_key", "_trainable_variables", "_learning_rate", "_momentums", "_reduction_axes", "_save_model",
    "_moments", "_iterations", "_variables", "_operations", "_functional", "_nodes_by_depth", "_run_through_graph",
    "_get_operation_for_node", "_outputs_struct", "_clear_losses", "_keras_mask", "_get_call_context",
    "_track_variable", "_get_variable_index", "_trainable_variables_indices", "_get_current_learning_rate",
    "_dict_to_ordered_dict", "_jit_compile", "_initial_epoch", "_symbolic_build",
})
ADAPTER = pathlib.Path(adapter.__file__).parent  # keras_lms/_keras_adapter/, the one exempt package
PACKAGE = ADAPTER.parent


def private_keras_uses(source: str) -> list[str]:
    """``keras.src`` imports, private Keras names (attributes, strings, overriding methods) and instance-dict reads
    of a named attribute (``x.__dict__["name"]``, ``vars(x)["name"]``) in ``source``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("keras.src")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith("keras.src") or (module == "keras" and any(a.name == "src" for a in node.names)):
                found.append(f"{where}: from {module} import ...")
        elif isinstance(node, ast.Attribute) and (node.attr in KERAS_PRIVATE_NAMES or node.attr == "src"
                                                  and isinstance(node.value, ast.Name) and node.value.id == "keras"):
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value in KERAS_PRIVATE_NAMES or node.value.startswith("keras.src")):
            found.append(f"{where}: {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in KERAS_PRIVATE_NAMES:
            found.append(f"{where}: def {node.name}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and (
                isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
                or isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "vars"):
            found.append(f"{where}: instance dict [{node.slice.value!r}]")
    return found


def outside_the_adapter(package: pathlib.Path = PACKAGE, adapter_dir: pathlib.Path = ADAPTER) -> list[pathlib.Path]:
    """The package's Python files the private-API scan covers: all of them but those of the adapter package."""
    return [path for path in sorted(package.rglob("*.py")) if adapter_dir not in path.parents]


def test_no_private_keras_api_outside_the_adapter():
    """Only the adapter package may use private Keras API (issue 14, item 5); everything else goes through it."""
    offenders = {}
    for path in outside_the_adapter():
        uses = private_keras_uses(path.read_text())
        if uses:
            offenders[str(path.relative_to(PACKAGE.parent))] = uses
    assert not offenders, f"private Keras API outside keras_lms/_keras_adapter/ (use the adapter): {offenders}"


def test_the_scan_exempts_exactly_the_adapter_package(tmp_path):
    """Negative control: only files inside the adapter directory are exempt, not a look-alike name elsewhere."""
    scanned = {path.relative_to(PACKAGE).as_posix() for path in outside_the_adapter()}
    assert {"model.py", "offload/torch/step.py", "horovod/averaging.py", "_keras_support.py"} <= scanned
    assert not any(name.startswith("_keras_adapter/") for name in scanned)
    assert len(list(ADAPTER.glob("*.py"))) > 1
    planted = ("_keras_adapter.py", "offload/_keras_adapter/x.py", "_keras_adapter_extra/y.py", "_keras_adapter/z.py")
    for name in planted:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("import keras.src.tree\n")
    scanned = outside_the_adapter(tmp_path, tmp_path / "_keras_adapter")
    found = {path.relative_to(tmp_path).as_posix() for path in scanned if private_keras_uses(path.read_text())}
    assert found == set(planted[:3]), found


@pytest.mark.parametrize("snippet", [
    "import keras.src.tree", "from keras.src.saving import object_registration", "from keras import src",
    "keras.src.backend.compute_output_spec", "import importlib; importlib.import_module('keras.src.tree')",
    "opt._var_key(v)", "getattr(opt, '_trainable_variables', None)", "x = inner._learning_rate",
    "m = opt._momentums", "unit._reduction_axes", "layer.__dict__['activation']", "vars(layer)['activation']",
    "class C(keras.callbacks.ModelCheckpoint):\n    def _save_model(self, epoch, batch, logs): ...",
])
def test_the_private_api_scan_finds_each_kind_of_use(snippet):
    """Negative control: the scan finds every kind of use it looks for."""
    assert private_keras_uses(snippet), snippet


def test_the_private_api_scan_finds_the_adapters_own_uses():
    uses = "\n".join(use for path in sorted(ADAPTER.glob("*.py")) for use in private_keras_uses(path.read_text()))
    for expected in ("from keras.src.layers.layer", "'_var_key'", "'_momentums'", "._nodes_by_depth"):
        assert expected in uses, expected


def test_recording_variable_reads_sees_what_a_call_reads_and_changes_nothing():
    """Canary for ``adapter.recording_variable_reads`` (Keras 3.15: ``Variable.value`` asks the innermost stateless
    scope's ``get_current_value``). It must see a Dense layer's kernel and bias, not a variable left unread
    (negative control), and leave values, updates and losses of an enclosing StatelessScope as they were."""
    dense, other = keras.layers.Dense(3), keras.layers.Dense(2)
    dense.build((None, 4))
    other.build((None, 4))
    x = keras.ops.ones((2, 4))
    with adapter.recording_variable_reads() as read:
        dense(x)
    assert [v.path for v in read] == [dense.kernel.path, dense.bias.path], (
        f"Keras {keras.__version__} changed what keras_lms._keras_adapter.recording_variable_reads() relies on "
        f"(written for Keras {adapter.SUPPORTED_KERAS})")
    assert all(v is not other.kernel for v in read)
    zeros = keras.ops.zeros(dense.kernel.shape)
    with keras.StatelessScope(state_mapping=[(dense.kernel, zeros)]) as outer:
        with adapter.recording_variable_reads():
            y = dense(x)
            dense.bias.assign(keras.ops.ones(dense.bias.shape))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(
        keras.ops.broadcast_to(dense.bias, (2, 3))))  # the outer scope's zero kernel was used
    assert outer.get_current_value(dense.bias) is not None  # the update reached the enclosing scope
