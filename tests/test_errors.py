"""Every bad input gets one clear error that names the fix."""

import keras
import numpy as np
import pytest

import keras_lms
from tests import models


@pytest.fixture(scope="module")
def model():
    return models.cnn_bn_dropout()


def test_wrap_non_model():
    with pytest.raises(TypeError, match="expects a keras.Model.*keras.Sequential"):
        keras_lms.wrap(keras.layers.Dense(3))
    with pytest.raises(TypeError, match="expects a keras.Model"):
        keras_lms.wrap("model.keras")


def test_wrap_unbuilt_model():
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built.*model.build"):
        keras_lms.wrap(unbuilt)


def test_wrap_twice(model):
    wrapped = keras_lms.wrap(model)
    with pytest.raises(ValueError, match="already wrapped.*unwrap"):
        keras_lms.wrap(wrapped)


def test_model_containing_wrapped_model(model):
    inp = keras.Input((16, 16, 3))
    outer = keras.Model(inp, keras_lms.wrap(model)(inp))
    with pytest.raises(ValueError, match="contains wrapped model.*unwrap"):
        keras_lms.wrap(outer)


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(min_bytes=-1), ValueError, "min_bytes must be >= 0"),
    (dict(min_bytes=1.5), TypeError, "min_bytes must be a non-negative integer"),
    (dict(min_bytes="lots"), ValueError, "not a size.*6GiB"),
    (dict(min_bytes=True), TypeError, "min_bytes"),
    (dict(keep_last=-2), ValueError, "keep_last must be >= 0"),
    (dict(keep_last=1.0), TypeError, "keep_last must be a non-negative integer"),
    (dict(prefetch=-1), ValueError, "prefetch must be >= 0"),
    (dict(prefetch="2"), TypeError, "prefetch must be a non-negative integer"),
    (dict(include=["no_such_layer"]), ValueError, "include names unknown layer.*no_such_layer.*model.summary"),
    (dict(exclude="conv2d_typo"), ValueError, "exclude names unknown layer"),
    (dict(include=[3]), TypeError, "include entries must be layer names"),
    (dict(host_device="/CPU:7"), ValueError, "does not exist.*available"),
    (dict(host_device="/GPU:0"), ValueError, "not a CPU device"),
    (dict(host_device="nonsense:device:x"), ValueError, "host_device"),
    (dict(device_budget="1KiB"), keras_lms.BudgetError, "cannot be met.*largest single layer call"),
    (dict(device_budget=0), ValueError, "device_budget must be > 0"),
    (dict(device_budget=-5), ValueError, "device_budget must be >= 0"),
    (dict(lean_normalization="yes"), TypeError, "lean_normalization must be True or False"),
    (dict(lean_normalization=1), TypeError, "lean_normalization must be True or False"),
])
def test_bad_config_values(model, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        keras_lms.wrap(model, **kwargs)


def test_config_and_keywords_together(model):
    with pytest.raises(ValueError, match="either config= or keyword"):
        keras_lms.wrap(model, config=keras_lms.LMSConfig(), min_bytes=0)
    with pytest.raises(TypeError, match="config must be a keras_lms.LMSConfig"):
        keras_lms.wrap(model, config={"min_bytes": 0})


def test_config_object_is_used(model):
    wrapped = keras_lms.wrap(model, config=keras_lms.LMSConfig(min_bytes="2KiB", keep_last=0))
    assert wrapped.lms_config.min_bytes == 2048 and wrapped.lms_config.keep_last == 0


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="on JAX the offload is built for XLA (next test)")
def test_jit_compile_refused(model):
    wrapped = keras_lms.wrap(model)
    with pytest.raises(ValueError, match="XLA.*jit_compile=False"):
        wrapped.compile(optimizer="sgd", loss="mse", jit_compile=True)
    wrapped.compile(optimizer="sgd", loss="mse")  # "auto" -> no XLA
    assert wrapped.jit_compile is False
    with pytest.raises(ValueError, match="XLA"):
        wrapped.jit_compile = True


@pytest.mark.jax
def test_jit_compile_is_xla_on_jax(model):
    """Keras' JAX trainer jits the step by default, and the JAX offload is built for what XLA compiles."""
    wrapped = keras_lms.wrap(model)
    wrapped.compile(optimizer="sgd", loss="mse")
    assert wrapped.jit_compile is True
    wrapped.compile(optimizer="sgd", loss="mse", jit_compile=False)
    assert wrapped.jit_compile is False
    with pytest.raises(ValueError, match="jit_compile must be True, False or 'auto'"):
        wrapped.compile(optimizer="sgd", loss="mse", jit_compile="yes")


def test_unwrap_rejects_plain_model(model):
    with pytest.raises(TypeError, match="unwrap expects a model returned by keras_lms.wrap"):
        keras_lms.unwrap(model)


def test_plan_needs_positive_batch(model):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        keras_lms.wrap(model).plan(batch_size=0)


def test_selectors_by_class_name_and_predicate(model):
    by_class = keras_lms.wrap(model, min_bytes=0, keep_last=0, include=[keras.layers.Conv2D])
    assert {e.layer_class for e in by_class.lms_plan if e.offloaded} == {"Conv2D"}
    by_pred = keras_lms.wrap(model, min_bytes=0, keep_last=0, exclude=lambda layer: "dropout" in layer.name)
    assert all(not e.offloaded for e in by_pred.lms_plan if "dropout" in e.layer)
    assert any(e.offloaded for e in by_pred.lms_plan)
    x = np.zeros((2, 16, 16, 3), "float32")
    by_class(x, training=True)  # runs


def test_the_constructor_checks_like_wrap_and_walks_the_model_once(model, monkeypatch):
    """`LMSModel(model, config)` is documented: it refuses what wrap() refuses, and the model is walked once."""
    with pytest.raises(TypeError, match="expects a keras.Model"):
        keras_lms.LMSModel(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="not built.*model.build"):
        keras_lms.LMSModel(keras.Sequential([keras.layers.Dense(3)]))
    with pytest.raises(ValueError, match="already wrapped.*unwrap"):
        keras_lms.LMSModel(keras_lms.wrap(model))
    with pytest.raises(TypeError, match="config must be a keras_lms.LMSConfig"):
        keras_lms.LMSModel(model, {"min_bytes": 0})
    from keras_lms import planning

    walks = []
    real = planning.model_structure
    monkeypatch.setattr(planning, "model_structure", lambda m: walks.append(m.name) or real(m))
    keras_lms.wrap(model)
    assert walks == [model.name], walks
