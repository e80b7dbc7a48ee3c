"""The host memory check (keras_lms/memory.py): its `HostMemoryError` reaches the user unchanged, even from
inside the user's own `tf.function`.

(tests/offload/torch/test_memory.py measures the torch step's memory; tests/test_batching.py checks the guard when the
batch axis is unknown.)
"""

import numpy as np
import pytest

import keras_lms
from tests import models


@pytest.mark.tensorflow(reason="the error must cross a user's tf.function")
def test_host_memory_error_passes_through_user_tf_function(monkeypatch):
    import tensorflow as tf

    from keras_lms import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 10)
    wrapped = keras_lms.wrap(models.conv_chain(), min_bytes=0, keep_last=0)
    x = np.zeros((4, 32, 32, 1), "float32")

    @tf.function
    def step():
        return wrapped(x, training=True)

    with pytest.raises(memory.HostMemoryError, match="host memory per step"):
        step()
