"""The Keras face: fit/evaluate/predict, save/load, unwrap, plans (either backend)."""

import keras
import numpy as np
import pytest

import keras_lms
from tests import models
from tests.oracle import restore, rng_state, set_rng_state, snapshot

RNG = np.random.default_rng(0)


def _data(n=32, size=16):
    x = RNG.random((n, size, size, 3)).astype("float32")
    y = RNG.random((n, 3)).astype("float32")
    return x, y


def test_fit_history_matches_plain():
    """2 epochs of model.fit, wrapped vs plain, from the same initial state and seeds."""
    model = models.cnn_bn_dropout()
    x, y = _data()
    start, rng = snapshot(model), rng_state()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    plain = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    plain_weights = snapshot(model)
    restore(model, start)
    set_rng_state(rng)  # torch: unseeded Dropout draws from torch's global RNG
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    lms = wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for key in ("loss", "mae"):
        np.testing.assert_allclose(lms[key], plain[key], rtol=1e-5)
    for a, b in zip(plain_weights, snapshot(model)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_predict_and_evaluate_use_plain_path():
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0)
    x = RNG.random((4, 32, 32, 1)).astype("float32")
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    wrapped.compile(loss="mse")
    model.compile(loss="mse")
    assert wrapped.evaluate(x, x, verbose=0) == pytest.approx(model.evaluate(x, x, verbose=0), rel=1e-6)


@pytest.mark.tensorflow(reason="reads the traced tf.function graph (torch: tests/offload/torch/test_training.py)")
def test_inference_graph_has_no_swap_ops():
    import tensorflow as tf

    wrapped = keras_lms.wrap(models.unet2d(), min_bytes=0)
    x = RNG.random((4, 32, 32, 1)).astype("float32")

    @tf.function
    def infer():
        return wrapped(x, training=False)

    ops = infer.get_concrete_function().graph.get_operations()
    assert not [op for op in ops if "lms_swap" in op.name]  # inference does not offload


def test_unwrap_shares_weights():
    model = models.resnet_blocks()
    wrapped = keras_lms.wrap(model)
    assert keras_lms.unwrap(wrapped) is model
    assert [id(v) for v in wrapped.trainable_variables] == [id(v) for v in model.trainable_variables]


def test_save_and_load_round_trip(tmp_path):
    model = models.cnn_bn_dropout()
    dropout = next(layer.name for layer in model.layers if isinstance(layer, keras.layers.Dropout))
    wrapped = keras_lms.wrap(model, min_bytes="4KiB", keep_last=2, exclude=[dropout, keras.layers.Dense], prefetch=2)
    wrapped.compile(optimizer="adam", loss="mse")
    x, y = _data(8)
    wrapped.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_lms.LMSModel)
    assert loaded.lms_config == wrapped.lms_config
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0), rtol=1e-6)
    loaded.fit(x, y, epochs=1, verbose=0)  # compiled state and optimizer came back
    plain_path = tmp_path / "plain.keras"
    keras_lms.unwrap(wrapped).save(plain_path)
    plain = keras.models.load_model(plain_path)
    assert not isinstance(plain, keras_lms.LMSModel)


def test_lms_plan_entries():
    wrapped = keras_lms.wrap(models.unet2d(), min_bytes=0, keep_last=1)
    plan = wrapped.lms_plan
    assert len(plan) == len(wrapped.plan(batch_size=4))
    assert [e.index for e in plan] == list(range(len(plan)))
    first = plan[0]
    assert first.layer == "conv2d" or first.layer_class == "Conv2D"
    assert first.shapes == [(1, 32, 32, 1)] and first.bytes == 32 * 32 * 4 and first.offloaded
    assert plan[-1].offloaded is False and "keep_last" in plan[-1].reason
    concat = next(e for e in plan if e.layer_class == "Concatenate")
    assert len(concat.shapes) == 2 and concat.offloaded
    # After a training step the plan reflects the real batch.
    wrapped(RNG.random((4, 32, 32, 1)).astype("float32"), training=True)
    assert wrapped.lms_plan[0].shapes == [(4, 32, 32, 1)]
    assert wrapped.offloaded_bytes_per_step == sum(e.new_host_bytes for e in wrapped.lms_plan) > 0


def test_example_plan_is_planned_once_until_what_it_depends_on_changes(monkeypatch):
    """wrap(device_budget=) plans at batch size 1; lms_plan and plan(1) reuse that plan instead of planning again
    (seconds for a large 3D model), but a frozen layer or a built optimizer changes the static bytes and re-plans."""
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, device_budget="64MiB", min_bytes=0, keep_last=1)
    planned = []
    original = keras_lms.LMSModel._plan_step
    monkeypatch.setattr(keras_lms.LMSModel, "_plan_step",
                        lambda self, *a: planned.append(a[-1]) or original(self, *a))
    first = list(wrapped.lms_plan)
    assert wrapped.plan(batch_size=1) == first and planned == []  # the plan wrap() made
    wrapped.plan(batch_size=2)
    assert planned == [2]
    model.layers[1].trainable = False  # fewer gradients: the static bytes change
    wrapped.plan(batch_size=1)
    assert planned == [2, 1]
    model.layers[1].trainable = True
    assert wrapped.plan(batch_size=1) == first and planned == [2, 1]  # as before: the first plan again
    wrapped.compile(optimizer="adam", loss="mse")
    wrapped.optimizer.build(wrapped.trainable_variables)
    wrapped.plan(batch_size=1)
    assert planned == [2, 1, 1]
    wrapped.forget_plans()
    wrapped.plan(batch_size=1)
    assert planned == [2, 1, 1, 1]


def test_shared_layer_has_one_plan_entry_per_call():
    wrapped = keras_lms.wrap(models.multi_io(), min_bytes=0, keep_last=0)
    calls = [e for e in wrapped.lms_plan if e.layer == "shared_dense"]
    assert len(calls) == 2
    assert any(e.layer_class not in dir(keras.layers) for e in wrapped.lms_plan)  # keras.ops nodes planned too


@pytest.mark.tensorflow(reason="a tf.GradientTape loop in a tf.function")
def test_custom_training_loop_with_optimizer():
    import tensorflow as tf

    model = models.resnet_blocks()
    wrapped = keras_lms.wrap(model, min_bytes=0)
    opt = keras.optimizers.Adam(1e-3)
    x = RNG.random((4, 16, 16, 3)).astype("float32")
    y = RNG.random((4, 4)).astype("float32")

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((wrapped(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, wrapped.trainable_variables)
        opt.apply_gradients(zip(grads, wrapped.trainable_variables))
        return loss

    losses = [float(step()) for _ in range(5)]
    assert losses[-1] < losses[0]


class _Batches(keras.utils.PyDataset):
    def __init__(self, n_batches=2, batch=4):
        super().__init__()
        self.n_batches, self.batch = n_batches, batch

    def __len__(self):
        return self.n_batches

    def __getitem__(self, i):
        x = np.full((self.batch, 32, 32, 1), i, "float32")
        return x, x


def test_fit_on_pydataset_plans_with_the_real_batch_size():
    """Keras traces PyDataset steps with an unknown batch axis; the plan must still be sized per batch."""
    wrapped = keras_lms.wrap(models.unet2d(), min_bytes="48KiB", keep_last=1)
    wrapped.compile(optimizer="sgd", loss="mse")
    wrapped.fit(_Batches(batch=4), epochs=1, verbose=0)
    assert wrapped.batch_size_hint == 4
    first = wrapped.lms_plan[1]  # BatchNorm after the first conv: 4 x 32 x 32 x 4 float32 = 64 KiB per step
    assert first.bytes == 4 * 32 * 32 * 4 * 4 and first.offloaded
    with pytest.raises(ValueError, match="batch_size_hint must be a positive integer"):
        wrapped.batch_size_hint = 0
