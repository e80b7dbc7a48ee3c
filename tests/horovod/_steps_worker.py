"""Ranks with different numbers of batches per epoch must not hang (issue 11, item 8).

Usage: KERAS_LMS_STEPS_MODE=known|unknown python tests/horovod/_steps_worker.py OUTDIR
Rank 0 trains on 32 samples, rank 1 on 24, batch 4: 8 vs 6 steps per epoch.

* known: NumPy arrays, so fit() knows the steps; BroadcastGlobalVariablesCallback/MetricAverageCallback
  compare them at train begin and every rank raises a ValueError that names the sharding.
* unknown: a generator-backed tf.data.Dataset (unknown cardinality), so nothing can be compared up front;
  rank 1 reaches its epoch end while rank 0 waits in the gradient allreduce of step 7; the callbacks' end-of-
  epoch marker pairs with that allreduce and both ranks raise (before: rank 1 entered MetricAverageCallback's
  allreduce and both waited forever).

Each rank writes OUTDIR/started<r> before fit, OUTDIR/epoch_end<r> (a wall-clock time) when its first epoch
ends, OUTDIR/error<r> with the exception text if fit raises (then exits 1), OUTDIR/finished<r> otherwise.
"""

import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_lms.horovod as lhvd

INFO = lhvd.init()
OUT = sys.argv[1]
MODE = os.environ.get("KERAS_LMS_STEPS_MODE", "known")
R = lhvd.rank()


def mark(name, text=""):
    with open(os.path.join(OUT, f"{name}{R}"), "w") as fh:
        fh.write(text)


class EpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            mark("epoch_end", repr(time.time()))


n = 32 if R == 0 else 24
rng = np.random.default_rng(R)
x = rng.normal(size=(n, 4)).astype("float32")
y = x[:, :1].copy()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
callbacks = [EpochEnd(), lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback()]
if MODE == "known":
    data = dict(x=x, y=y, batch_size=4)
else:
    import tensorflow as tf

    def gen():
        for i in range(0, n, 4):
            yield x[i:i + 4], y[i:i + 4]

    ds = tf.data.Dataset.from_generator(gen, output_signature=(tf.TensorSpec((None, 4), tf.float32),
                                                               tf.TensorSpec((None, 1), tf.float32)))
    data = dict(x=ds)
mark("started")
try:
    model.fit(**data, epochs=3, verbose=0, callbacks=callbacks)
except Exception as exc:
    mark("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    print(f"rank {R}: fit raised {type(exc).__name__}: {str(exc)[:500]}", flush=True)
    sys.exit(1)
mark("finished")
