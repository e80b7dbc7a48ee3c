"""keras-lms' callbacks: MemoryHighWaterMark (defined here) and BackupAndRestore (keras_lms.backup).

MemoryHighWaterMark writes memory high-water marks into the normal Keras logs: writing into `logs` (instead of
printing) means the numbers appear in History, the progress bar, CSVLogger and TensorBoard with no extra code.
BackupAndRestore is a drop-in for Keras' preemption callback that writes atomically and resumes exactly.
"""

from __future__ import annotations

import csv
import os

import keras

from keras_lms import memory
from keras_lms.backup import BackupAndRestore
from keras_lms.backup_store import BackupError

__all__ = ["MemoryHighWaterMark", "BackupAndRestore", "BackupError"]

KEYS = ("peak_device_mib", "peak_host_rss_mib", "offloaded_mib")


class MemoryHighWaterMark(keras.callbacks.Callback):
    """Write device and host memory high-water marks into the normal Keras logs.

    Adds `peak_device_mib`, `peak_host_rss_mib` and `offloaded_mib` (MiB, floats) to every epoch's logs, so
    they appear in `History`, the progress bar, `CSVLogger` and TensorBoard with no extra code. The device
    peak is reset at the start of each epoch (or batch) and read at its end; the host peak is the process's
    RSS high-water mark over the same span (Linux; the current RSS elsewhere). `offloaded_mib` is the host
    memory the wrapped model's plan holds per step (`0` for an unwrapped model). The device peak is `nan`
    when the back end keeps no allocator statistics (TensorFlow on CPU unless `TF_CPU_ALLOCATOR_USE_BFC=true`
    is set before TensorFlow is imported; torch without CUDA; JAX on CPU); a warning says so once. On JAX, XLA's
    allocator cannot restart its peak: `peak_device_mib` is the process's peak so far (`memory_stats()`'s
    `peak_bytes_in_use`), which never falls from one epoch to the next.

    Args:
        device: the device whose allocator peak is read, e.g. `"GPU:0"` (TensorFlow), `"cuda:0"` (torch) or
            `"gpu:0"` (JAX).
            Defaults to the first GPU, else the CPU allocator.
        csv_path: also append one row per epoch (or per batch) to this CSV file: a str or path in an existing,
            writable directory (checked here and again when training begins). An existing non-empty file is
            appended to without a second header. Defaults to `None` (no file).
        per_batch: reset and read the peaks around every training batch and add the keys to the batch logs
            too; the epoch's values are then the largest batch values. Defaults to `False`.
        across_ranks: under Horovod with more than one rank, also log `<key>_min` / `<key>_max` over all
            ranks. This runs an allgather at every reading, so *every* rank must have the callback (not inside
            `keras_lms.horovod.rank0_only`, which refuses it). Defaults to `False`: each rank logs only its own
            readings and no collective runs, so the callback is safe wherever it is placed.

    Raises:
        TypeError: `device` is not a str, `per_batch` or `across_ranks` is not a bool, or `csv_path` is not a
            path.
        ValueError: `csv_path` is a directory.
        FileNotFoundError: `csv_path`'s directory does not exist.
        PermissionError: `csv_path` is not writable.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms

    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    wrapped = keras_lms.wrap(model, min_bytes=0)
    wrapped.compile(optimizer="sgd", loss="mse")
    history = wrapped.fit(np.zeros((8, 32)), np.zeros((8, 1)), batch_size=4, epochs=2, verbose=0,
                          callbacks=[keras_lms.MemoryHighWaterMark()])
    print(history.history["peak_host_rss_mib"], history.history["offloaded_mib"])
    ```
    """

    def __init__(self, device: str | None = None, csv_path=None, per_batch: bool = False,
                 across_ranks: bool = False):
        super().__init__()
        if device is not None and not isinstance(device, str):
            raise TypeError(f"device must be a device string such as 'GPU:0'; got {device!r}.")
        if not isinstance(per_batch, bool):
            raise TypeError(f"per_batch must be True or False; got {per_batch!r}.")
        if not isinstance(across_ranks, bool):
            raise TypeError(f"across_ranks must be True or False; got {across_ranks!r}.")
        self.device = device
        self.csv_path = None if csv_path is None else _check_csv_path(csv_path)
        self.per_batch = per_batch
        self.across_ranks = across_ranks
        # Read by keras_lms.horovod.rank0_only: a callback that runs a collective must be on every rank.
        self._hvd_collective = across_ranks
        self._epoch = 0
        self._epoch_max = {}
        self._csv_header_written = False

    def _device(self) -> str:
        if self.device is None:
            self.device = memory.default_device()
        return self.device

    def _reset(self):
        memory.reset_device_peak(self._device())
        memory.reset_host_peak()

    def _readings(self) -> dict:
        peak = memory.device_peak_bytes(self._device())
        offloaded = getattr(self.model, "offloaded_bytes_per_step", 0) or 0
        values = {
            "peak_device_mib": float("nan") if peak is None else peak / memory.MIB,
            "peak_host_rss_mib": memory.host_peak_rss_bytes() / memory.MIB,
            "offloaded_mib": offloaded / memory.MIB,
        }
        if self.across_ranks:
            values.update(_across_ranks(values))
        return values

    def _record(self, logs, batch=None, values=None):
        values = self._readings() if values is None else values
        if logs is not None:
            logs.update(values)
        if self.csv_path is not None:
            self._write_csv(values, batch)
        return values

    def _write_csv(self, values, batch):
        fields = ["epoch", "batch"] + sorted(values)
        with open(self.csv_path, "a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields)
            if not self._csv_header_written:
                if fh.tell() == 0:  # appending to an earlier run's file: its header is already there
                    writer.writeheader()
                self._csv_header_written = True
            writer.writerow({"epoch": self._epoch, "batch": "" if batch is None else batch, **values})

    def on_train_begin(self, logs=None):
        if self.csv_path is not None:
            _check_csv_path(self.csv_path)  # the directory may have gone since construction

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_max = {}
        self._reset()

    def on_train_batch_begin(self, batch, logs=None):
        if self.per_batch:
            self._reset()

    def on_train_batch_end(self, batch, logs=None):
        if self.per_batch:
            values = self._record(logs, batch)
            for key, value in values.items():
                self._epoch_max[key] = max(value, self._epoch_max.get(key, value))

    def on_epoch_end(self, epoch, logs=None):
        # Per batch, peaks were reset every batch: the epoch's value is the largest batch value.
        values = dict(self._epoch_max) if self.per_batch and self._epoch_max else self._readings()
        if logs is not None:
            logs.update(values)
        if self.csv_path is not None and not self.per_batch:
            self._write_csv(values, None)


def _check_csv_path(csv_path) -> str:
    """`csv_path` as a str, or a clear error now instead of a failure at the end of the first epoch."""
    if isinstance(csv_path, bool) or not isinstance(csv_path, (str, os.PathLike)):
        raise TypeError(
            f"csv_path must be a file path (str or pathlib.Path); got {csv_path!r} of type "
            f"{type(csv_path).__name__}. An integer would be taken as an open file descriptor."
        )
    path = os.fspath(csv_path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        example = os.path.join(path, "memory.csv")
        raise ValueError(f"csv_path={path!r} is a directory; give a file name, e.g. {example!r}.")
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"csv_path={path!r}: the directory {directory!r} does not exist. Create it first "
            "(os.makedirs(..., exist_ok=True)) or choose another path."
        )
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"csv_path={path!r} is not writable; choose a path in a directory you can write to.")
    return path


def _across_ranks(values: dict) -> dict:
    """min/max of each value over Horovod ranks (a collective: only with `across_ranks=True`, on every rank)."""
    hvd = memory.initialized_horovod()
    if hvd is None or hvd.size() < 2:
        return {}
    import tensorflow as tf

    local = tf.constant([[values[k] for k in KEYS]], dtype=tf.float64)
    gathered = hvd.allgather(local, name="keras_lms_memory_high_water_mark").numpy()
    out = {}
    for i, key in enumerate(KEYS):
        out[f"{key}_min"] = float(gathered[:, i].min())
        out[f"{key}_max"] = float(gathered[:, i].max())
    return out
