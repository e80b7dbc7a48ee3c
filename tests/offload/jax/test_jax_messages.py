"""Under KERAS_BACKEND=jax, ``keras_lms.horovod`` (TensorFlow only, by design: docs/horovod.md) says in one line
which back end it needs (data parallelism on JAX: ``keras.distribution.DataParallel``, test_data_parallel.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("jax")



pytestmark = pytest.mark.jax


def test_horovod_says_it_needs_tensorflow_in_one_line(monkeypatch):
    monkeypatch.delitem(sys.modules, "keras_lms.horovod", raising=False)
    monkeypatch.delitem(sys.modules, "keras_lms.horovod._hvd", raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module("keras_lms.horovod")
    message = str(error.value)
    assert "\n" not in message
    assert "only the TensorFlow backend" in message and "'jax'" in message
