"""One elastic Horovod worker (launched by tests/horovod/test_horovod_elastic.py through `horovodrun --min-np`).

Trains a small wrapped conv model (BatchNorm, Dropout, offload of every call) with keras_lms.horovod's
DistributedOptimizer, `hvd.elastic.KerasState(model, batch=0, epoch=0)` and the three elastic callbacks, and
writes what the test checks into OUTDIR:

* ``events-<pid>.jsonl``: one line per commit (rank, size, epoch, batch, a digest of the trainable weights, the
  optimizer's iterations) and per reset;
* ``final-<pid>.json``: at the end, the rank, size, the state's counters, the weights' digest and the last
  MemoryHighWaterMark logs.

Environment: ``ELASTIC_EPOCHS``, ``ELASTIC_STEPS`` (batches per epoch), ``ELASTIC_PACE`` (seconds slept after
each batch, so the test can change the hosts mid-run), ``ELASTIC_KILL`` = "epoch:batch:rank" (that rank SIGKILLs
itself once, after that batch's commit; a marker file makes it happen once per job).
Negative controls: ``ELASTIC_CONTROL=upstream_run`` trains under upstream's ``horovod.tensorflow.elastic.run``
(which does not recognise our collectives' failure); ``ELASTIC_CONTROL=no_retrace`` keeps the compiled step
across resets (``KerasState.reset`` does nothing).
"""

import hashlib
import json
import os
import signal
import sys
import time

import keras
import numpy as np

import keras_lms
import keras_lms.horovod as hvd

hvd.init()
OUT = sys.argv[1]
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
STEPS = int(os.environ.get("ELASTIC_STEPS", "8"))
PACE = float(os.environ.get("ELASTIC_PACE", "0.2"))
KILL = os.environ.get("ELASTIC_KILL")


def build():
    keras.utils.set_random_seed(0)  # the same initial weights on every rank (sync broadcasts them anyway)
    inp = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(1)(x))


def dataset():
    import tensorflow as tf

    rng = np.random.default_rng(100 + hvd.rank())
    x = rng.random((64, 8, 8, 1)).astype("float32")
    y = x.mean(axis=(1, 2, 3))[:, None]
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4)


def digest(variables) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()[:16]


model = keras_lms.wrap(build(), min_bytes=0, keep_last=0)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse", jit_compile=False)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)  # unbuilt optimizer: sync() builds it
EVENTS = os.path.join(OUT, f"events-{os.getpid()}.jsonl")


def log(**record):
    record.update(pid=os.getpid(), rank=hvd.rank(), size=hvd.size(), time=time.time())
    with open(EVENTS, "a") as f:
        f.write(json.dumps(record) + "\n")


state.register_reset_callbacks([lambda: log(event="reset")])


class Observe(keras.callbacks.Callback):
    """After the commit of each batch: log it, pace the run, and die where ELASTIC_KILL says."""

    def on_train_batch_end(self, batch, logs=None):
        log(event="commit", epoch=state.epoch, batch=state.batch, weights=digest(state.model.trainable_variables),
            iterations=int(state.optimizer.iterations.numpy()))
        if KILL:
            epoch, at, who = (int(p) for p in KILL.split(":"))
            marker = os.path.join(OUT, "killed")
            if (state.epoch, state.batch, hvd.rank()) == (epoch, at, who) and not os.path.exists(marker):
                open(marker, "w").write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PACE)


memory = keras_lms.MemoryHighWaterMark()
callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
    Observe(),
    memory,
]


CONTROL = os.environ.get("ELASTIC_CONTROL")
if CONTROL == "no_retrace":
    hvd.elastic.KerasState.reset = lambda self: None
run = hvd.elastic.run
if CONTROL == "upstream_run":
    from horovod.tensorflow.elastic import run


@run
def train(state):
    return state.model.fit(dataset(), steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks,
                           verbose=0)


log(event="start")
history = train(state)
with open(os.path.join(OUT, f"final-{os.getpid()}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch, "batch": state.batch,
               "weights": digest(state.model.trainable_variables),
               "iterations": int(state.optimizer.iterations.numpy()),
               "memory_logs": None if history is None else  # upstream's run can swallow the failure: None
               {k: history.history[k][-1] for k in ("peak_host_rss_mib", "offloaded_mib")}}, f)
