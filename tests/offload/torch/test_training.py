"""torch back end through Keras' own training loop: fit histories, compile rules, evaluate/predict, save/load."""

import keras
import numpy as np
import pytest
import torch

import keras_lms
from keras_lms.offload import torch as lms_torch
from tests import models
from tests.oracle import restore, rng_state, set_rng_state, snapshot

pytestmark = pytest.mark.torch


def _data():
    rng = np.random.default_rng(0)
    x = rng.random((16, 32, 32, 1)).astype("float32")
    y = (rng.random((16, 32, 32, 1)) > 0.5).astype("float32")
    return x, y


@pytest.mark.slow
def test_fit_history_matches_plain():
    """Two epochs of model.fit (Adam, BatchNorm, Dropout): the wrapped model's history equals the plain one's."""
    x, y = _data()
    model = models.unet2d()
    start, rng = snapshot(model), rng_state()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
    plain = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    trained_plain = snapshot(model)
    restore(model, start)
    set_rng_state(rng)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, prefetch=2)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
    lms_torch.reset_transfer_stats()
    history = wrapped.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert lms_torch.transfer_stats()["d2h_copies"] > 0
    assert history.keys() == plain.keys()
    for key in plain:
        np.testing.assert_allclose(history[key], plain[key], rtol=1e-5)
    for a, b in zip(snapshot(model), trained_plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_compile_refuses_jit_compile():
    wrapped = keras_lms.wrap(models.cnn_bn_dropout())
    with pytest.raises(ValueError, match="jit_compile"):
        wrapped.compile(optimizer="sgd", loss="mse", jit_compile=True)
    wrapped.compile(optimizer="sgd", loss="mse")  # 'auto' resolves to False (no torch.compile)
    assert wrapped.jit_compile is False


def test_evaluate_and_predict_run_the_plain_model():
    x, y = _data()
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0)
    model.compile(loss="binary_crossentropy")
    wrapped.compile(loss="binary_crossentropy")
    lms_torch.reset_transfer_stats()
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert wrapped.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), rel=1e-6)
    assert lms_torch.transfer_stats()["offloaded_calls"] == 0


def test_save_and_load_round_trip(tmp_path):
    x, y = _data()
    wrapped = keras_lms.wrap(models.unet2d(), min_bytes=0, keep_last=2, prefetch=3)
    wrapped.compile(optimizer="adam", loss="binary_crossentropy")
    wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "wrapped.keras"
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_lms.LMSModel)
    assert loaded.lms_config.keep_last == 2 and loaded.lms_config.prefetch == 3
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0), rtol=1e-6)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_gradient_accumulates_into_torch_parameters():
    """Keras' torch trainer reads v.value.grad after loss.backward(): the weights are Function inputs."""
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    for v in model.trainable_variables:
        v.value.grad = None
    wrapped(torch.rand(2, 16, 16, 3), training=True).square().mean().backward()
    assert all(v.value.grad is not None and v.value.grad.abs().sum() > 0 for v in model.trainable_variables)
