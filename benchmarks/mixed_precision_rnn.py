"""Mixed precision with LSTMs: is the wrapped/plain gradient difference the recompute, or rounding order?

    python benchmarks/mixed_precision_rnn.py float32|mixed_float16|mixed_bfloat16

Two stacked LSTMs, forced offload, one step on the same weights: prints the loss plain and wrapped, and the
largest relative gradient difference wrapped vs plain, plain vs a float64 reference, wrapped vs float64.
Results and the conclusion are in docs/design.md ("Numerical exactness").
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_lms


def build():
    keras.utils.set_random_seed(0)
    inp = keras.Input((20, 8))
    x = keras.layers.LSTM(32, return_sequences=True)(inp)
    x = keras.layers.LSTM(16)(x)
    return keras.Model(inp, keras.layers.Dense(1, dtype="float32")(x))


def gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    return loss.numpy(), [g.numpy().astype("float64") for g in tape.gradient(loss, model.trainable_variables)]


def relative(a, b) -> float:
    return max(np.abs(p - q).max() / (np.abs(q).max() + 1e-30) for p, q in zip(a, b))


def main(policy: str) -> None:
    keras.mixed_precision.set_dtype_policy(policy)
    x = np.random.default_rng(0).normal(size=(16, 20, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
    model = build()
    weights = [v.numpy() for v in model.weights]
    loss_plain, grads_plain = gradients(model, x, y)
    for var, value in zip(model.weights, weights):
        var.assign(value)
    loss_wrapped, grads_wrapped = gradients(keras_lms.wrap(model, min_bytes=0, keep_last=0), x, y)
    keras.mixed_precision.set_dtype_policy("float64")  # the reference: same weights, float64 throughout
    reference = build()
    for var, value in zip(reference.weights, weights):
        var.assign(value.astype("float64"))
    _, grads_64 = gradients(reference, x.astype("float64"), y.astype("float64"))
    print(policy, "loss plain", loss_plain, "wrapped", loss_wrapped)
    print("wrapped vs plain", relative(grads_wrapped, grads_plain), " plain vs f64", relative(grads_plain, grads_64),
          " wrapped vs f64", relative(grads_wrapped, grads_64))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mixed_float16")
