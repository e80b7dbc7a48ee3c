"""Planning for the batch that really arrives when the traced step does not say it (keras_lms/batching.py).

Keras traces the step with an unknown batch axis for `tf.data` without `drop_remainder`, and a Python generator
says nothing about its batches in advance: the plan must still offload what it would for the real batch, be
redone when a later batch is larger, and keep the host memory check (either backend unless marked).
"""

import keras
import numpy as np
import pytest

import keras_lms
from tests import models

RNG = np.random.default_rng(11)


def _generator(batches):
    x, y = models.conv_chain_data(sum(batches), rng=RNG)
    start = 0
    for b in batches:
        yield x[start:start + b], y[start:start + b]
        start += b


def _tf_data(batch):
    import tensorflow as tf

    # no drop_remainder: None batch axis
    return tf.data.Dataset.from_tensor_slices(models.conv_chain_data(rng=RNG)).batch(batch)


# 8 samples x 32x32x8 float32 = 256 KiB per conv input; one sample = 32 KiB: min_bytes between the two.
@pytest.mark.parametrize("make_data", [
    pytest.param(lambda: _tf_data(8), marks=pytest.mark.tensorflow(reason="a tf.data pipeline")),
    lambda: _generator([8, 8, 4]),
], ids=["tfdata_no_drop_remainder", "generator"])
def test_unknown_batch_axis_plans_for_the_real_batch(make_data):
    reference = keras_lms.wrap(models.conv_chain(), min_bytes="100KiB", keep_last=1)
    reference.compile("sgd", "mse")
    x, y = models.conv_chain_data(16, rng=RNG)
    reference.fit(x, y, batch_size=8, epochs=1, verbose=0)
    wrapped = keras_lms.wrap(models.conv_chain(), min_bytes="100KiB", keep_last=1)
    wrapped.compile("sgd", "mse")
    wrapped.fit(make_data(), epochs=1, verbose=0)
    offloaded = [e.layer for e in wrapped.lms_plan if e.offloaded]
    assert offloaded == [e.layer for e in reference.lms_plan if e.offloaded] and offloaded
    # TensorFlow traces one step (batch axis None) and plans it for the largest batch seen (8); torch plans every
    # step for its own batch, and the last one had 4 samples.
    last_batch = 8 if keras.backend.backend() == "tensorflow" else 4
    assert wrapped.offloaded_bytes_per_step == reference.offloaded_bytes_per_step * last_batch // 8


def test_generator_with_a_larger_later_batch_is_replanned():
    wrapped = keras_lms.wrap(models.conv_chain(), min_bytes="100KiB", keep_last=1)
    wrapped.compile("sgd", "mse")
    wrapped.fit(_generator([2, 2, 2, 2, 8, 8, 8]), epochs=1, verbose=0)
    assert wrapped.batch_size_hint == 8
    assert any(e.offloaded for e in wrapped.lms_plan)


@pytest.mark.tensorflow(reason="a tf.data pipeline (an unknown batch axis in the traced step)")
def test_unknown_batch_axis_host_memory_guard(monkeypatch):
    from keras_lms import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 600 << 10)  # 600 KiB "free"
    wrapped = keras_lms.wrap(models.conv_chain(), min_bytes=0, keep_last=0)
    wrapped.compile("sgd", "mse")
    with pytest.raises(memory.HostMemoryError, match="host memory per step"):
        wrapped.fit(_tf_data(8), epochs=1, verbose=0)
