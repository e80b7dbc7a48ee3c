"""Mixed precision with LSTMs: is the wrapped/plain gradient difference the recompute, or rounding order?

    python benchmarks/mixed_precision_rnn.py float32|mixed_float16|mixed_bfloat16

Two stacked LSTMs, forced offload, one step on the same weights: prints the loss plain and wrapped, and the
largest relative gradient difference wrapped vs plain, plain vs a float64 reference, wrapped vs float64.
Results and the conclusion are in docs/design.md ("Numerical exactness").
"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"]="2"
import numpy as np, tensorflow as tf, keras, keras_lms
policy = sys.argv[1]
keras.mixed_precision.set_dtype_policy(policy)
def build():
    keras.utils.set_random_seed(0)
    inp = keras.Input((20, 8))
    x = keras.layers.LSTM(32, return_sequences=True)(inp)
    x = keras.layers.LSTM(16)(x)
    return keras.Model(inp, keras.layers.Dense(1, dtype="float32")(x))
x = np.random.default_rng(0).normal(size=(16, 20, 8)).astype("float32"); y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
m = build(); w0 = [v.numpy() for v in m.weights]
def grads(model):
    with tf.GradientTape() as t:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    return loss.numpy(), [g.numpy().astype("float64") for g in t.gradient(loss, model.trainable_variables)]
lp, gp = grads(m)
for v, a in zip(m.weights, w0): v.assign(a)
wr = keras_lms.wrap(m, min_bytes=0, keep_last=0)
lw, gw = grads(wr)
# float64 reference of same weights
keras.mixed_precision.set_dtype_policy("float64")
m64 = build()
for v, a in zip(m64.weights, w0): v.assign(a.astype("float64"))
with tf.GradientTape() as t:
    loss = tf.reduce_mean((m64(x.astype("float64"), training=True) - y) ** 2)
g64 = [g.numpy() for g in t.gradient(loss, m64.trainable_variables)]
def rel(a, b): return max(np.abs(p - q).max() / (np.abs(q).max() + 1e-30) for p, q in zip(a, b))
print(policy, "loss plain", lp, "wrapped", lw)
print("wrapped vs plain", rel(gw, gp), " plain vs f64", rel(gp, g64), " wrapped vs f64", rel(gw, g64))
