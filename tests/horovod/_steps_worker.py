"""Ranks with different numbers of batches per epoch must not hang (issue 11, item 8).

Usage: python tests/horovod/_steps_worker.py OUTDIR
Rank 0 trains on 32 samples, rank 1 on 24, batch 4: 8 vs 6 steps per epoch. Two modes, one after the other in
the same job (one TensorFlow start-up instead of two); the first fails before any training step, at the same
collective on every rank, so the second starts from a clean Horovod state:

* known: NumPy arrays, so fit() knows the steps; BroadcastGlobalVariablesCallback/MetricAverageCallback
  compare them at train begin and every rank raises a ValueError that names the sharding.
* unknown: a generator-backed tf.data.Dataset (unknown cardinality), so nothing can be compared up front;
  rank 1 reaches its epoch end while rank 0 waits in the gradient allreduce of step 7; the callbacks' end-of-
  epoch marker pairs with that allreduce and both ranks raise (before: rank 1 entered MetricAverageCallback's
  allreduce and both waited forever).

Each rank writes, in OUTDIR/<mode>/: started<r> before fit, epoch_end<r> (a wall-clock time) when its first epoch
ends, error<r> with the exception text and failed_at<r> (a wall-clock time) if fit raises, finished<r> otherwise.
The job exits 1 when a mode raised (both should).
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
R = lhvd.rank()


def mark(mode, name, text=""):
    os.makedirs(os.path.join(OUT, mode), exist_ok=True)
    with open(os.path.join(OUT, mode, f"{name}{R}"), "w") as fh:
        fh.write(text)


class EpochEnd(keras.callbacks.Callback):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            mark(self.mode, "epoch_end", repr(time.time()))


def train(mode) -> bool:
    """Fit with 8 vs 6 batches per epoch; True if fit raised (as it should)."""
    n = 32 if R == 0 else 24
    rng = np.random.default_rng(R)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = x[:, :1].copy()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
    callbacks = [EpochEnd(mode), lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback()]
    if mode == "known":
        data = dict(x=x, y=y, batch_size=4)
    else:
        import tensorflow as tf

        def gen():
            for i in range(0, n, 4):
                yield x[i:i + 4], y[i:i + 4]

        ds = tf.data.Dataset.from_generator(gen, output_signature=(tf.TensorSpec((None, 4), tf.float32),
                                                                   tf.TensorSpec((None, 1), tf.float32)))
        data = dict(x=ds)
    mark(mode, "started")
    try:
        model.fit(**data, epochs=3, verbose=0, callbacks=callbacks)
    except Exception as exc:
        mark(mode, "failed_at", repr(time.time()))
        mark(mode, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        print(f"rank {R} ({mode}): fit raised {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        return True
    mark(mode, "finished")
    return False


failed = [train(mode) for mode in ("known", "unknown")]
sys.exit(1 if any(failed) else 0)
