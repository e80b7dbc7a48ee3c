"""BackupAndRestore: Keras' preemption callback, made atomic, checked on resume and exact (Dropout included).

Keras' `keras.callbacks.BackupAndRestore` rewrites its files in place and leaves out the random-seed state, so a
kill at the wrong moment leaves a backup that does not load, pairs new weights with an old epoch, or resumes a
model with Dropout on other masks than the uninterrupted run would have drawn. This callback keeps Keras'
arguments and meanings and changes what is written and when (`keras_lms.backup_store` has the file protocol,
`keras_lms.backup_contents` the files, `keras_lms.backup_ranks` the agreement of Horovod ranks):

* one backup is one unit: weights and optimizer (`model.save_weights`, the plain model's layout for a wrapped
  model), the random-seed generators' states and the metrics of the interrupted epoch (`state.npz`), and the
  training position (epoch and batches into it) in the backup's name and manifest;
* a resumed epoch passes over the batches the interrupted run had already trained (Keras restarts the epoch), so
  the resumed run trains on the same batches, with the same masks, as an uninterrupted one.
"""

from __future__ import annotations

import os
import warnings

import keras

from keras_lms import _keras_adapter as adapter
from keras_lms import backup_contents as contents
from keras_lms import random_state
from keras_lms.backup_contents import KERAS_FILES, STATE, WEIGHTS  # noqa: F401 - where users and tests read them
from keras_lms.backup_ranks import agreed_backups
from keras_lms.backup_ranks import distributed_horovod as _horovod
from keras_lms.backup_store import Backup, BackupError, BackupStore


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state atomically and resume exactly after a preemption; a drop-in for Keras' callback.

    Use it like `keras.callbacks.BackupAndRestore`: pass it to `fit`, and when the job is killed (a spot GPU is
    taken away, a node fails), run the same command again. `fit` then resumes from the last backup; when training
    completes the backups are deleted (unless `delete_checkpoint=False`). Differences from Keras' callback:

    - A backup is written into a hidden directory and renamed into place once every file is flushed to disk and
      listed, with its size and SHA-256, in a manifest, so a kill at any moment leaves the previous backup whole.
      Keras rewrites its files in place.
    - It holds weights, optimizer variables (with `iterations`), the states of the random-seed generators
      (Dropout's, random augmentation layers'), the running metrics and the position (epoch, and batches into
      it). Keras' holds no seed state, so a model with Dropout does not resume exactly.
    - A mid-epoch backup (`save_freq=<int>`) resumes at the next batch: the batches already trained are read
      and passed over. Keras restarts the epoch. A run that is killed and resumed therefore ends with the same
      weights, bit for bit, as one that was not, given data in a fixed order (`shuffle=False`, or a dataset
      whose order does not depend on how many epochs the process has run) and
      `keras.utils.set_random_seed` before the model is built.
    - Every file is checked against the manifest before it is read. A damaged newest backup is skipped, with a
      warning naming it, for the previous one (kept with `double_checkpoint=True`); when none is usable, a
      `BackupError` names the directory and what to do, instead of an h5py traceback.
    - Under Horovod with more than one rank (`keras_lms.horovod`), each rank writes to
      `backup_dir/rank-<rank>`, the previous backup is always kept, and on resume the ranks agree on the newest
      backup that every rank has, so they restart at the same batch (every rank must have the callback).
      Horovod is detected only if the program imported and initialised it. Restart with the same number of ranks.
    - A directory holding only a backup of Keras' own callback is resumed the way Keras would (from the start of
      its epoch, not exactly), with a warning, so switching to this callback mid-run loses nothing.

    Layout and protocol: see docs/usage.md, "Resuming after preemption".

    Args:
        backup_dir: the directory for the backups, a str or path (created when the first backup is written).
            Use it for one training run only, as with Keras' callback.
        save_freq: `"epoch"` to back up at the end of every epoch, or a positive int to back up every
            `save_freq` batches (counted across epochs, as Keras does). Defaults to `"epoch"`.
        double_checkpoint: keep the previous backup as well as the newest one, to fall back on if the newest is
            damaged after it was written. Defaults to `False` (the previous one is deleted once the new one is
            complete, so a kill mid-write still leaves one).
        delete_checkpoint: delete `backup_dir` (under Horovod, this rank's `rank-<rank>` directory) when training
            completes. Defaults to `True`.

    Raises:
        ValueError: `backup_dir` is empty, `save_freq` is neither `"epoch"` nor a positive int, or (when training
            begins) the model is not built or the backup was written for a different model.
        TypeError: `double_checkpoint` or `delete_checkpoint` is not a bool.
        keras_lms.callbacks.BackupError: (when training begins) backups exist but none can be restored.

    Example:

    ```python
    import tempfile
    import keras
    import numpy as np
    import keras_lms

    class Preempted(keras.callbacks.Callback):  # stands in for a spot instance taken away
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("preempted")

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    x, y = np.random.default_rng(0).random((16, 4)), np.zeros((16, 1))
    backup = keras_lms.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=3)
    try:
        build().fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Preempted()])
    except RuntimeError:
        pass
    resumed = build()  # the same command, run again
    history = resumed.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    print(history.epoch)  # [1, 2, 3]: epoch 1 from its third batch (where the last backup was taken), then 2, 3
    ```
    """

    _hvd_collective = True  # under Horovod the ranks agree on a backup with an allgather: every rank needs it

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True):
        super().__init__()
        if backup_dir is None or not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"backup_dir must be a non-empty directory path; received: backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                "save_freq must be 'epoch' or a positive number of batches; received: "
                f"save_freq={save_freq!r}."
            )
        for name, value in (("double_checkpoint", double_checkpoint), ("delete_checkpoint", delete_checkpoint)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False; received: {name}={value!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        # Keras' counters, with Keras' meanings (keras/src/callbacks/backup_and_restore.py).
        self._current_epoch = 0
        self._last_batch_seen = 0
        self._batches_seen_since_last_saving = 0
        self._hvd = None
        self._store = None
        self._resume = None  # (epoch, steps) of the backup this fit resumed from mid-epoch
        self._skipper = None
        self._resume_state = {}
        self._initial_epoch_before = None

    # ------------------------------------------------------------ where and what
    @property
    def directory(self) -> str:
        """This process's backup directory: `backup_dir`, or `backup_dir/rank-<rank>` under multi-rank Horovod."""
        hvd = _horovod()
        if hvd is None:
            return os.path.abspath(self.backup_dir)
        return os.path.join(os.path.abspath(self.backup_dir), f"rank-{hvd.rank()}")

    def _save(self, steps: int) -> None:
        written = self._store.write(self._current_epoch, steps, lambda tmp: contents.write(self.model, tmp),
                                    contents.describe(self.model))
        self._store.prune(written, keep=2 if (self.double_checkpoint or self._hvd is not None) else 1)

    # --------------------------------------------------------------- resuming
    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                f"BackupAndRestore needs a built model; model {model.name!r} is not built. Build it before fit() "
                "(give it an Input, call model.build(input_shape), or call it on a batch)."
            )
        self._hvd = _horovod()
        self._store = BackupStore(self.directory)
        self._current_epoch = self._last_batch_seen = self._batches_seen_since_last_saving = 0
        self._resume = None
        self._resume_state = {}
        self._initial_epoch_before = adapter.initial_epoch(model)
        backup = self._restore_newest()
        if backup is None:
            return
        adapter.set_initial_epoch(model, backup.epoch)
        self._current_epoch = backup.epoch
        if backup.steps and adapter.can_skip_train_steps(model):
            self._last_batch_seen = backup.steps - 1
            self._resume = (backup.epoch, backup.steps)
            self._skipper = adapter.skipping_train_function(model, backup.steps, on_done=self._at_backup_point)
            model.train_function = self._skipper
            return
        if backup.steps:  # outside fit() (no train function to wrap), or on a back end keras-lms cannot skip on
            warnings.warn(
                f"BackupAndRestore: the interrupted epoch {backup.epoch} restarts from its first batch (as in Keras), "
                "so the resumed run is not exact: passing over trained batches needs fit() on TensorFlow, torch or "
                f"JAX (here: {keras.backend.backend()}).",
                stacklevel=2,
            )
        self._at_backup_point()

    def _at_backup_point(self) -> None:
        """Where the interrupted run took the backup: put back the process's generators and the epoch's metrics."""
        if self._resume_state:  # (a backup of Keras' callback has none)
            random_state.restore_process(self._resume_state)
        if self._resume is not None:
            contents.assign_metrics(self.model, contents.metrics(self._resume_state))

    def _restore_newest(self) -> Backup | None:
        """Restore the newest usable backup (the one all ranks have, under Horovod) and return it; None: none yet."""
        store = self._store
        candidates, problems = [], []
        backups = store.backups()
        for backup in backups:
            problem = store.problem(backup)
            if problem is None:
                candidates.append(backup)
                if self._hvd is None:
                    break  # alone, the newest good one is enough; the ranks need all of them to agree on one
            else:
                problems.append(f"{backup.name}: {problem}")
        anyone_has_backups = bool(backups)
        if self._hvd is not None:  # the same decision on every rank, or one would wait forever for the others
            candidates, anyone_has_backups = agreed_backups(self._hvd, candidates, problems, anyone_has_backups)
        if not candidates:
            if anyone_has_backups:
                raise BackupError(
                    f"BackupAndRestore: no usable backup in {store.directory!r} ({'; '.join(problems)}). Restore the "
                    "directory from a copy, or delete it to train from the start."
                )
            return None if self._hvd is not None else contents.load_keras_backup(self.model, store.directory)
        backup = candidates[0]
        if problems:
            warnings.warn(
                f"BackupAndRestore: skipped backup(s) in {store.directory!r} that cannot be used "
                f"({'; '.join(problems)}); resuming from the previous good one, {backup.path!r}.",
                stacklevel=3,
            )
        store.discard_newer_than(backup)  # damaged ones, or (Horovod) ones some rank did not finish
        store.remove_leftovers()
        self._resume_state = contents.load(self.model, backup)
        return backup

    # ---------------------------------------------------------------- training
    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._resume is not None and self._resume[0] == self._current_epoch and batch < self._resume[1]:
            if batch + 1 >= self._resume[1]:
                self._stop_skipping()
            return  # a batch trained before the backup, passed over: Keras' counters already include it
        if self._should_save_on_batch(batch):
            self._save(steps=self._last_batch_seen + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._current_epoch = epoch + 1
        self._last_batch_seen = 0
        self._stop_skipping()
        self._resume = None
        if self.save_freq == "epoch":
            self._save(steps=0)

    def _should_save_on_batch(self, batch) -> bool:
        """Keras' batch counting (supports `steps_per_execution`): True every `save_freq` batches."""
        if self.save_freq == "epoch":
            return False
        if batch <= self._last_batch_seen:  # a new epoch
            add_batches = batch + 1
        else:
            add_batches = batch - self._last_batch_seen
        self._batches_seen_since_last_saving += add_batches
        self._last_batch_seen = batch
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._batches_seen_since_last_saving = 0
            return True
        return False

    def _stop_skipping(self) -> None:
        if self._skipper is not None and self.model.train_function is self._skipper:
            self.model.train_function = self._skipper.original
        self._skipper = None

    def on_train_end(self, logs=None):
        self._stop_skipping()
        self._resume = None
        adapter.set_initial_epoch(self.model, self._initial_epoch_before)  # a later fit() starts where it says
        if self.delete_checkpoint and self._store is not None:
            self._store.remove_all()
            if self._hvd is not None:
                try:
                    os.rmdir(os.path.abspath(self.backup_dir))  # the last rank to finish removes backup_dir
                except OSError:
                    pass
