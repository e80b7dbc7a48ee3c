"""Horovod's own `test_elastic_state` (test/parallel/test_tensorflow2_keras.py, 0.28.1) against
keras_lms.horovod, with only the imports changed (`import keras_lms.horovod as hvd`, `keras` for `tf.keras`), run
for a plain model, a `keras_lms.wrap`-ped model and under mixed precision (a LossScaleOptimizer).

`run_cases()` is a scenario of tests/horovod/_worker.py (it needs `hvd.init()` first, and runs collectives on every
rank); tests/horovod/test_horovod_multirank.py asserts on its outcome per case. It needs no elastic launch: the
state's `sync`/`commit`/`restore` work in a plain one, as in Horovod's own suite.
"""

import traceback

import keras
import numpy as np
import tensorflow as tf

import keras_lms
import keras_lms.horovod as hvd


def assert_all_close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def upstream_test_elastic_state(wrap=False, elastic=None):
    elastic = elastic or hvd.elastic
    # ---- Horovod's test body (test_tensorflow2_keras.py::test_elastic_state), imports changed ----
    v = 1.0 if hvd.rank() == 0 else 2.0
    model1 = keras.Sequential([
        keras.layers.Dense(2, activation='softmax')
    ])
    model1.build((2, 2))
    model1.set_weights(
        [np.array([[v, v], [v, v]], dtype=np.float32),
         np.array([v, v], dtype=np.float32)])
    if wrap:  # ours: the same test on a keras_lms.wrap-ped model
        model1 = keras_lms.wrap(model1, min_bytes=0)

    model2 = keras.Sequential([
        keras.layers.Dense(2, activation='softmax')
    ])
    model2.build((2, 2))
    model2.set_weights(
        [np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32),
         np.array([0.0, 0.0], dtype=np.float32)])

    optimizer = tf.optimizers.Adam(0.001 * hvd.size())
    if keras.mixed_precision.global_policy().name == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)

    state = elastic.KerasState(model1, optimizer, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()

    model1_weights = model1.get_weights()
    model2_weights = model2.get_weights()

    # After sync, all values should match the root rank
    for w in state.model.get_weights():
        assert_all_close(w, np.ones_like(w))
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then restore
    model1.set_weights(model2_weights)
    state.batch = 21
    state.epoch = 11

    state.restore()

    for w1, w2 in zip(model1.get_weights(), model1_weights):
        assert_all_close(w1, w2)
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then commit
    model1.set_weights(model2_weights)
    state.batch = 21
    state.epoch = 11

    state.commit()
    state.restore()

    for w1, w2 in zip(model1.get_weights(), model2_weights):
        assert_all_close(w1, w2)
    assert state.batch == 21
    assert state.epoch == 11
    # ---- ours: the optimizer was built by sync(), identically on both ranks ----
    return len(optimizer.variables)


def upstream_elastic():
    """Negative control: Horovod's own Keras elastic state on Keras 3."""
    from horovod.tensorflow.keras import elastic

    return elastic


def run_cases() -> dict:
    """Each case's outcome: `{"ok": True, "optimizer_variables": n}` or `{"ok": False, "error": traceback}`."""
    results = {}
    try:
        for case in ("plain", "wrapped", "mixed_float16", "control_upstream"):
            keras.mixed_precision.set_global_policy("mixed_float16" if case == "mixed_float16" else "float32")
            try:
                elastic = upstream_elastic() if case == "control_upstream" else None
                results[case] = {"ok": True,
                                 "optimizer_variables": upstream_test_elastic_state(case == "wrapped", elastic)}
            except Exception:
                results[case] = {"ok": False, "error": traceback.format_exc()[-600:]}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return results
