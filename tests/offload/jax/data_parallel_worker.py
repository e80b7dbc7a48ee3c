"""Run by test_data_parallel.py in a fresh process (XLA's CPU device count is fixed when JAX starts).

Trains the same BatchNorm + Dropout conv model three times from the same weights and prints JSON:
``reference`` plain on one device at the global batch, ``data_parallel`` wrapped under
``keras.distribution.DataParallel`` on every device at the same global batch, and ``half_batch`` plain on one
device at the per-device batch (the control: a comparison that cannot tell these apart proves nothing).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np

import keras_lms

GLOBAL_BATCH, STEPS = 8, 3


def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 2))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Dropout(0.2, seed=5)(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2DTranspose(4, 2, strides=2)(x)
    return keras.Model(inputs, keras.layers.Conv2D(1, 1)(x))


def train(model, batch_size):
    rng = np.random.default_rng(1)
    x = rng.random((GLOBAL_BATCH * STEPS, 16, 16, 2)).astype("float32")
    y = rng.random((GLOBAL_BATCH * STEPS, 16, 16, 1)).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x[: batch_size * STEPS], y[: batch_size * STEPS], batch_size=batch_size, shuffle=False,
                        verbose=0)
    inner = keras_lms.unwrap(model) if isinstance(model, keras_lms.LMSModel) else model
    devices = sorted({str(d) for v in inner.weights for d in v.value.sharding.device_set})
    return {"loss": history.history["loss"][-1], "variables": [np.asarray(v.value).tolist() for v in inner.variables],
            "paths": [v.path for v in inner.variables],
            "devices": devices}


def main():
    result = {"devices": [str(d) for d in jax.devices()]}
    result["reference"] = train(build(), GLOBAL_BATCH)
    result["half_batch"] = train(build(), GLOBAL_BATCH // 2)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    wrapped = keras_lms.wrap(build(), min_bytes=0, keep_last=0)
    result["data_parallel"] = train(wrapped, GLOBAL_BATCH)
    result["offloaded"] = sum(entry.offloaded for entry in wrapped.lms_plan)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
