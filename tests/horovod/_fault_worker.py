"""A rank that fails mid-epoch: the launcher must end the whole job with a non-zero status, not hang.

Usage: python tests/horovod/_fault_worker.py OUTDIR
Rank 1 raises at the start of its third training batch; rank 0 is then blocked in that batch's allreduce.
Each rank writes OUTDIR/started<r> once training runs, so the test can tell a crash at start-up from the
intended failure.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_lms.horovod as lhvd

lhvd.init()
OUT = sys.argv[1]


class FailOnRank1(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            open(os.path.join(OUT, f"started{lhvd.rank()}"), "w").close()
        if lhvd.rank() == 1 and batch == 2:
            raise RuntimeError("injected failure on rank 1")


x = np.random.default_rng(lhvd.rank()).normal(size=(64, 4)).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0,
          callbacks=[lhvd.BroadcastGlobalVariablesCallback(0), FailOnRank1()])
open(os.path.join(OUT, f"finished{lhvd.rank()}"), "w").close()
