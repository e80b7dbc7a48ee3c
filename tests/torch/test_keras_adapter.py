"""torch back end: what keras_lms/_keras_adapter.py relies on where the torch back end differs."""

import keras
import numpy as np
import torch

from keras_lms import _keras_adapter as adapter


def test_meta_fallback_retry_starts_from_the_first_attempts_state():
    """Keras' torch compute_output_spec retries on real tensors when an op has no meta kernel (UpSampling2D),
    in the same StatelessScope: the BatchNorm statistics the meta attempt stored there must not reach the
    retry (they are meta tensors). This is the planning trace of every wrapped model."""
    inp = keras.Input((8, 8, 2))
    model = keras.Model(inp, keras.layers.UpSampling2D()(keras.layers.BatchNormalization()(inp)))
    spec = adapter.compute_output_spec(lambda t: model(t, training=True), keras.KerasTensor((2, 8, 8, 2)))
    assert tuple(spec.shape) == (2, 16, 16, 2)
    assert not any(v.value.is_meta for v in model.variables)


def test_call_in_context_replays_training_on_torch():
    """The torch recompute runs in the autograd backward (outside Layer.__call__): the replayed context turns
    the inner Dropout of a composite layer without ``training`` on."""

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.drop = keras.layers.Dropout(0.5)

        def call(self, x):
            return self.drop(x)

    block = Block()
    inp = keras.Input((64,))
    model = keras.Model(inp, block(inp))
    bound = []
    with adapter.patched_calls([block], lambda op, original: bound.append(original) or original):
        model(torch.ones(4, 64), training=True)
    x = torch.ones(4, 64)
    assert torch.equal(block.call(x), x)  # outside any call context: inference mode
    dropped = bound[0](x)
    assert 0.2 < float((dropped == 0).float().mean()) < 0.8
    np.testing.assert_array_equal(np.unique(dropped.numpy()), [0.0, 2.0])
