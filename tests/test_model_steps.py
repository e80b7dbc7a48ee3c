"""Models with their own train_step, compute_loss or test_step: the wrapper delegates the step and still offloads.

A wrapped model whose class overrides the step must train exactly like the plain one (same history, same
weights), with the forward pass inside the custom step planned and offloaded (either backend).
"""

import keras
import numpy as np
import pytest

import keras_lms

RNG = np.random.default_rng(11)


def _dense_net(cls, name):
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name=f"{name}_d1")(inp)
    h = keras.layers.Dense(16, activation="relu", name=f"{name}_d2")(h)
    out = keras.layers.Dense(2, name=f"{name}_out")(h)
    return cls(inp, out, name=name)


def _loss_and_gradients(model, compute):
    """``compute()`` and its gradients for ``model.trainable_variables``, as the Keras guide writes a custom
    train_step for each backend (``tf.GradientTape``; torch: ``zero_grad``, ``backward``, ``.grad``)."""
    if keras.backend.backend() == "torch":
        model.zero_grad()
        loss = compute()
        loss.backward()
        return loss, [v.value.grad for v in model.trainable_variables]
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = compute()
    return loss, tape.gradient(loss, model.trainable_variables)


def _apply(model, grads):
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            model.optimizer.apply(grads, model.trainable_variables)
    else:
        model.optimizer.apply(grads, model.trainable_variables)


def _jax_train_step(model, state, data, loss_of, update_metrics):
    """A custom train_step as the Keras guide writes it for JAX: stateless, ``(state, data) -> (logs, state)``.

    ``loss_of(y, y_pred, x)`` is the step's loss; ``update_metrics(metric, values, loss, y, y_pred)`` returns a
    metric's new variable values.
    """
    import jax

    trainable, non_trainable, optimizer_vars, metrics_vars = state
    x, y = data

    def compute(trainable, non_trainable):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_of(y, y_pred, x), (y_pred, non_trainable)

    (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(compute, has_aux=True)(trainable, non_trainable)
    trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads, trainable)
    logs, new_metrics, start = {}, [], 0
    for metric in model.metrics:
        values = metrics_vars[start:start + len(metric.variables)]
        start += len(metric.variables)
        values = update_metrics(metric, values, loss, y, y_pred)
        logs[metric.name] = metric.stateless_result(values)
        new_metrics += list(values)
    return logs, (trainable, non_trainable, optimizer_vars, new_metrics)


class DoubleLossStep(keras.Model):
    """A custom train_step whose loss is twice the compiled loss."""

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            def update(metric, values, loss, y, y_pred):
                if metric.name == "loss":
                    return metric.stateless_update_state(values, loss)
                return metric.stateless_update_state(values, y, y_pred)

            return _jax_train_step(self, *args, lambda y, y_pred, x: 2.0 * self.compute_loss(x=x, y=y, y_pred=y_pred),
                                   update)
        (data,) = args
        x, y = data
        y_pred = None

        def compute():
            nonlocal y_pred
            y_pred = self(x, training=True)
            return 2.0 * self.compute_loss(x=x, y=y, y_pred=y_pred)

        loss, grads = _loss_and_gradients(self, compute)
        _apply(self, grads)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class L1PlusLoss(keras.Model):
    """compute_loss overridden: adds the mean absolute prediction."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return base + 0.5 * keras.ops.mean(keras.ops.abs(y_pred))


class TrackerStep(keras.Model):
    """Own loss tracker, own metrics property, own test_step (the Keras guide's pattern)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="my_loss")

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return _jax_train_step(self, *args, lambda y, y_pred, x: keras.ops.mean((y_pred - y) ** 2) * 3.0,
                                   lambda metric, values, loss, y, y_pred: metric.stateless_update_state(values, loss))
        (data,) = args
        x, y = data
        loss, grads = _loss_and_gradients(self, lambda: keras.ops.mean((self(x, training=True) - y) ** 2) * 3.0)
        _apply(self, grads)
        self.tracker.update_state(loss)
        return {"my_loss": self.tracker.result()}

    def test_step(self, *args):
        if keras.backend.backend() == "jax":
            state, (x, y) = args
            trainable, non_trainable, metrics_vars = state
            y_pred, _ = self.stateless_call(trainable, non_trainable, x, training=False)
            values = self.tracker.stateless_update_state(metrics_vars, keras.ops.mean((y_pred - y) ** 2) * 3.0)
            return {"my_loss": self.tracker.stateless_result(values)}, (trainable, non_trainable, values)
        (data,) = args
        x, y = data
        loss = keras.ops.mean((self(x, training=False) - y) ** 2) * 3.0
        self.tracker.update_state(loss)
        return {"my_loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def _weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights]


@pytest.mark.parametrize("cls", [DoubleLossStep, L1PlusLoss, TrackerStep])
def test_custom_steps_train_exactly_like_the_plain_model(cls):
    x = RNG.random((32, 8)).astype("float32")
    y = RNG.random((32, 2)).astype("float32")
    plain = _dense_net(cls, "plain")
    wrapped_inner = _dense_net(cls, "inner")
    wrapped_inner.set_weights(plain.get_weights())
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    plain_hist = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    wrapped = keras_lms.wrap(wrapped_inner, min_bytes=0, keep_last=0)
    wrapped.compile(keras.optimizers.SGD(0.1), "mse")
    lms_hist = wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert sorted(lms_hist) == sorted(plain_hist)
    for key in plain_hist:
        np.testing.assert_allclose(lms_hist[key], plain_hist[key], rtol=1e-5)
    for a, b in zip(_weights(plain), _weights(wrapped_inner)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert any(e.offloaded for e in wrapped.lms_plan)  # the custom step's forward pass was offloaded
    assert wrapped.lms_plan[0].shapes == [(8, 8)]
    assert wrapped.delegates_steps
    if cls is TrackerStep:
        np.testing.assert_allclose(wrapped.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5)


def test_default_step_models_are_not_delegated():
    wrapped = keras_lms.wrap(_dense_net(keras.Model, "plain_default"))
    assert not wrapped.delegates_steps
