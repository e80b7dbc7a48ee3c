"""In-process checks of the learning-rate callbacks' optimizer helpers (no Horovod collective, no launch)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.horovod
if keras.backend.backend() != "tensorflow":  # pragma: no cover - conftest already skips tests/horovod on torch
    pytest.skip("keras_lms.horovod needs the TensorFlow backend", allow_module_level=True)
lr_callbacks = pytest.importorskip("keras_lms.horovod.learning_rate", exc_type=ImportError)


def compiled(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("make", [lambda: keras.optimizers.SGD(0.1),
                                  lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))])
def test_a_float_learning_rate_is_settable(make):
    model = compiled(make())
    assert lr_callbacks._settable_lr_optimizer(model) is model.optimizer


@pytest.mark.parametrize("learning_rate,named", [
    (keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9), "ExponentialDecay"),
    (lambda: 0.1, "a callable"),
])
def test_a_schedule_or_callable_learning_rate_is_refused_by_name(learning_rate, named):
    with pytest.raises(ValueError, match=rf"float learning_rate.*uses {named}"):
        lr_callbacks._settable_lr_optimizer(compiled(keras.optimizers.SGD(learning_rate)))


def test_no_optimizer_is_refused():
    with pytest.raises(ValueError, match="no optimizer"):
        lr_callbacks._settable_lr_optimizer(keras.Sequential([keras.layers.Dense(1)]))


@pytest.mark.parametrize("make,count", [
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 2),
    (lambda: keras.optimizers.RMSprop(0.1, momentum=0.9), 2),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.1, momentum=0.9)), 2),
    (lambda: keras.optimizers.SGD(0.1), 0),
    (lambda: keras.optimizers.RMSprop(0.1), 0),
    (lambda: keras.optimizers.Adam(0.1), 0),
])
def test_momentum_buffers_are_the_optimizers_momentum_variables(make, count):
    model = compiled(make())
    assert lr_callbacks._momentum_buffers(model.optimizer) == []  # not built yet: nothing to correct
    model.optimizer.build(model.trainable_variables)
    buffers = lr_callbacks._momentum_buffers(model.optimizer)
    assert len(buffers) == count
    optimizer_variables = getattr(model.optimizer, "inner_optimizer", model.optimizer).variables
    for buffer, weight in zip(buffers, model.trainable_variables):
        assert any(buffer is v for v in optimizer_variables) and tuple(buffer.shape) == tuple(weight.shape)
        assert not np.any(np.asarray(buffer.numpy()))
