"""Under KERAS_BACKEND=jax, what is not there yet says so in one line (issue 27): ``wrap()`` names the back ends
it supports, and ``keras_lms.horovod`` (TensorFlow only, by design: docs/horovod.md) names the one it needs."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("jax")

import keras

import keras_lms

pytestmark = pytest.mark.jax


def test_horovod_says_it_needs_tensorflow_in_one_line(monkeypatch):
    monkeypatch.delitem(sys.modules, "keras_lms.horovod", raising=False)
    monkeypatch.delitem(sys.modules, "keras_lms.horovod._hvd", raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module("keras_lms.horovod")
    message = str(error.value)
    assert "\n" not in message
    assert "only the TensorFlow backend" in message and "'jax'" in message


def test_wrap_names_the_supported_back_ends():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(NotImplementedError, match=r"TensorFlow and torch backends; KERAS_BACKEND is 'jax'"):
        keras_lms.wrap(model)
