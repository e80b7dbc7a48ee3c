"""The TensorFlow back end's output-based gradient shortcuts are exact: the wrapped model's gradients equal the
plain model's bit for bit in float32, on inputs with exact zeros and near-ties, with and without oneDNN.

A shortcut reads an activation's *output* (its host copy) instead of recomputing the layer. It is only kept if
it runs the op TensorFlow's own gradient runs, on the same tensor. Max pooling failed that (issue 10): a lone
``MaxPool3DGrad`` is another kernel than the plain model's under oneDNN, so pooling is recomputed.
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest
import tensorflow as tf
from keras import layers

import keras_lms
from keras_lms.offload.tensorflow import output_gradients as lms_tf
from tests import models
from tests.oracle import compare_step

pytestmark = pytest.mark.tensorflow(reason="the TensorFlow back end's output-gradient shortcuts and kernels")

ROOT = str(pathlib.Path(__file__).resolve().parents[3])


def _exact():
    """Bit-identical on CPU; GPU convolution gradients may use non-deterministic (atomic) reductions. (Asked when
    a test runs: listing devices initialises TensorFlow, which a torch session collecting this module must not.)"""
    return 0.0 if not tf.config.list_logical_devices("GPU") else 1e-5


def activation_chain(size=8):
    """Every shortcut once: activation layers and Dense/Conv layers with fused activations, chained.

    The linear 1x1 stem keeps the input's exact zeros and near-ties (see ``models.near_ties``)."""
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(4, 1, use_bias=False)(inp)
    x = layers.ReLU()(x)
    x = layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    x = layers.Activation("sigmoid")(x)
    x = layers.Conv2D(4, 3, padding="same", activation="sigmoid")(x)
    x = layers.Activation("tanh")(x)
    x = layers.Conv2D(4, 3, padding="same", activation="tanh")(x)
    x = layers.Activation("elu")(x)
    x = layers.Conv2D(4, 3, padding="same", activation="elu")(x)
    x = layers.Activation("relu")(x)
    x = layers.Flatten()(x)
    for act in ("relu", "sigmoid", "tanh", "elu"):
        x = layers.Dense(8, activation=act)(x)
    return keras.Model(inp, layers.Dense(2)(x), name="activation_chain")


def chain_inputs(size=8):
    x = models.near_ties((4, size, size, 3)) - 0.5  # negatives and exact zeros for relu/elu
    x[:, ::3] = 0.0
    return x


class _Uses:
    """Counts how often the shortcuts' gradient functions really run (so the comparison is not vacuous)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("input_gradient_from_output", "fused_activation_grad"):
            monkeypatch.setattr(lms_tf, name, self._counting(getattr(lms_tf, name)))

    def _counting(self, lookup):
        def counted_lookup(unit):
            found = lookup(unit)
            return None if found is None else self._count(found)
        return counted_lookup

    def _count(self, fn):
        def counted(*args):
            self.count += 1
            return fn(*args)
        return counted


def assert_exact(build, data):
    model = build()
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0), data)
    worst = max(result["grads"].values())
    exact = _exact()
    assert worst <= exact, f"{model.name}: wrapped gradients differ from the plain model's by {worst:.3g}"
    assert result["loss"] <= exact and result["outputs"] <= exact


def test_output_gradient_shortcuts_match_plain_exactly(monkeypatch):
    uses = _Uses(monkeypatch)
    assert_exact(activation_chain, chain_inputs())
    assert uses.count >= 13  # each of the 5 activation layers, 4 fused Conv2D and 4 fused Dense at least once


@pytest.mark.parametrize("pool", [layers.MaxPooling2D(2), layers.MaxPooling3D(2),
                                  layers.MaxPooling2D(3, strides=2, padding="same")])
def test_max_pooling_is_recomputed(pool):
    """No standalone pooling gradient: it differs from the plain model's under oneDNN (issue 10)."""
    assert lms_tf.input_gradient_from_output(pool) is None


# Run in a fresh interpreter: oneDNN is chosen when TensorFlow loads (on by default only on some x86 CPUs,
# e.g. with AVX-512 VNNI; off on the CI's). Exit code 77: this TensorFlow build cannot turn it on.
_ONEDNN_SCRIPT = """
import sys
from tensorflow.python.util import _pywrap_util_port
if not _pywrap_util_port.IsMklEnabled():
    sys.exit(77)
from tests import models
from tests.offload.tensorflow.test_output_gradients import activation_chain, assert_exact, chain_inputs
assert_exact(activation_chain, chain_inputs())
build, data = models.ORACLE_CASES["cnn3d_maxpool"]
assert_exact(build, data())
"""


def test_exact_under_onednn():
    """With oneDNN the plain model pairs max pooling with its gradient through a workspace; the wrapped one
    must get the same kernels (before issue 10's fix: 0.7-130x relative error on cnn3d_maxpool)."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-c", _ONEDNN_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode == 77:
        pytest.skip("this TensorFlow build has no oneDNN")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
