"""Callbacks of the segmentation examples: throughput, data epochs, atomic checkpoints, resume state, schedule.

:func:`make_callbacks` puts them, Horovod's and keras-lms' ``MemoryHighWaterMark`` in the order that matters.
"""

from __future__ import annotations

import math
import os
import pathlib
import time

import keras

import keras_lms

if __package__:  # imported as examples.callbacks (python -m examples.segmentation_3d, the tests)
    from .runtime import Runtime
    from .state import CHECKPOINT, STATE, jsonable, write_json
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from runtime import Runtime
    from state import CHECKPOINT, STATE, jsonable, write_json


class Throughput(keras.callbacks.Callback):
    """Logs ``samples_per_s`` (all ranks together) per epoch, from the end of the first batch to the last one.

    Batch 0 is left out because it includes tracing the training step (seconds); with a single step per epoch
    the whole step is timed.
    """

    def __init__(self, global_batch: int):
        super().__init__()
        self.global_batch = int(global_batch)
        self._t0 = self._t_first = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._t0, self._t_first, self._batches = time.perf_counter(), None, 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self._t_last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._batches:
            return
        if self._batches > 1:
            seconds, batches = self._t_last - self._t_first, self._batches - 1
        else:
            seconds, batches = self._t_last - self._t0, 1
        logs["samples_per_s"] = batches * self.global_batch / max(seconds, 1e-9)


class DataEpoch(keras.callbacks.Callback):
    """Tells the training data which epoch starts (fresh synthetic samples / random crops per epoch, and the
    same ones again when a run is resumed at that epoch)."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def on_epoch_begin(self, epoch, logs=None):
        self.dataset.set_epoch(epoch)


class AtomicCheckpoint(keras.callbacks.Callback):
    """Saves the model after every epoch to a temporary file next to ``path`` and moves it into place.

    ``os.replace`` is atomic on POSIX file systems: a kill or crash during the save leaves the previous epoch's
    checkpoint intact (keras.callbacks.ModelCheckpoint writes the target file in place). Put it only in rank 0's
    callback list.
    """

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = pathlib.Path(path)

    def on_epoch_end(self, epoch, logs=None):
        tmp = self.path.with_name(f".{self.path.stem}.tmp{self.path.suffix}")
        try:
            self.model.save(tmp)
            os.replace(tmp, self.path)
        finally:
            if tmp.exists():
                tmp.unlink()


class RunState(keras.callbacks.Callback):
    """Writes ``checkpoint.json`` after each epoch: completed epochs (for ``--resume``) and all epoch logs.

    Put it after AtomicCheckpoint: the JSON then never names an epoch whose checkpoint is not on disk.
    """

    def __init__(self, path: pathlib.Path, history: list, meta: dict):
        super().__init__()
        self.path, self.history, self.meta = pathlib.Path(path), history, meta

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1}
        row.update({k: jsonable(v) for k, v in (logs or {}).items()})
        self.history.append(row)
        write_json(self.path, {"epoch": epoch + 1, "checkpoint": CHECKPOINT, "history": self.history, **self.meta})


def cosine_schedule(peak_lr: float, warmup_epochs: int, epochs: int):
    """``schedule(epoch, lr)`` for LearningRateScheduler: untouched during warm-up (the warm-up callback sets the
    rate per batch there), then ``peak_lr * (1 + cos(pi * t)) / 2`` with ``t`` going from 0 to almost 1."""

    def schedule(epoch, lr):
        if epoch < warmup_epochs:
            return lr
        span = max(1, epochs - warmup_epochs)
        return float(peak_lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / span)))

    return schedule


def make_callbacks(args, rt: Runtime, out: pathlib.Path, history: list, resumed: bool, meta: dict,
                   train_ds) -> list:
    """The callback list, in the order that matters.

    The data epoch first, Horovod callbacks next (weights broadcast; averaged epoch logs before anyone reads
    them), then the learning-rate schedule, the memory high-water marks (every rank: it gathers min/max over
    ranks) and throughput, then the rank-0-only writers: CSV log, checkpoint, resume state. Keras adds its
    progress bar last, so it shows averaged values.
    """
    callbacks = [DataEpoch(train_ds)]
    warmup = 0
    if rt.hvd is not None:
        callbacks += [rt.hvd.BroadcastGlobalVariablesCallback(0), rt.hvd.MetricAverageCallback()]
        if args.warmup_epochs > 0:
            warmup = args.warmup_epochs
            callbacks.append(rt.hvd.LearningRateWarmupCallback(initial_lr=args.lr * rt.size, warmup_epochs=warmup))
    if args.lr_schedule == "cosine":
        callbacks.append(keras.callbacks.LearningRateScheduler(cosine_schedule(args.lr * rt.size, warmup, args.epochs)))
    # across_ranks: every rank runs this callback, so it may allgather (the summary reports the max over ranks).
    callbacks += [keras_lms.MemoryHighWaterMark(across_ranks=rt.hvd is not None), Throughput(args.batch_size * rt.size)]
    if rt.is_root:
        callbacks += [
            keras.callbacks.CSVLogger(str(out / "training_log.csv"), append=resumed),
            AtomicCheckpoint(out / CHECKPOINT),
            RunState(out / STATE, history, meta),
        ]
    return callbacks
