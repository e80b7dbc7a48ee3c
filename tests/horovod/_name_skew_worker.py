"""Ranks whose Keras layer-name counters differ must still agree on their gradient allreduce.

Usage: python tests/horovod/_name_skew_worker.py OUTDIR
Rank 1 builds a throw-away Dense layer and model first, so its training model's auto-generated layer names
(and with them its gradient tensors' names) differ from rank 0's (``dense_1`` vs ``dense``). A collective named
after those tensors never matches across ranks and the job hangs. Each rank writes OUTDIR/rank<r>.json with its
final weights' digest and the layer names it used.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_lms.horovod as lhvd

lhvd.init()
OUT = sys.argv[1]

if lhvd.rank() == 1:  # skew the per-process layer-name counters
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(2)])

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(lhvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), "mse")
x = np.random.default_rng(lhvd.rank()).normal(size=(32, 4)).astype("float32")
model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[lhvd.BroadcastGlobalVariablesCallback(0)])
weights = np.concatenate([w.ravel() for w in model.get_weights()])
with open(os.path.join(OUT, f"rank{lhvd.rank()}.json"), "w") as fh:
    json.dump({"layers": [layer.name for layer in model.layers], "weights": weights.tolist()}, fh)
