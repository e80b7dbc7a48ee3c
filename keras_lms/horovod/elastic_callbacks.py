"""Upstream Horovod's three elastic Keras callbacks on Keras 3: commit the state, and keep its batch and epoch.

Why not upstream's: `UpdateBatchStateCallback` shortens a resumed epoch by editing `params["steps"]`, which Keras 3
ignores, and stores the last batch index (a batch would run twice). These keep upstream's names and arguments;
give them the `KerasState` (`keras_lms.horovod.elastic_state`) and pass them to `fit` on every rank.
"""

from __future__ import annotations

import keras


class CommitStateCallback(keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at every epoch end (upstream's callback).

    Args:
        state: the `KerasState`.
        batches_per_commit: batches between commits. Defaults to `1`.

    Returns:
        The callback, for `fit(callbacks=[...])` on every rank.

    Raises:
        ValueError: `batches_per_commit` is not a positive integer.

    Example:

    ```python
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]
    ```
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive integer; got {batches_per_commit!r}.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self._hvd_collective = True  # a commit checks host updates with a broadcast: every rank must have it

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` = the batches finished in the current epoch, and resume an epoch where it stopped.

    Upstream shortens the first epoch after a reset by editing `params["steps"]`, which Keras 3 ignores; here the
    resumed epoch really runs only its remaining batches (the epoch ends early, and `fit` goes on with the next
    one). `state.batch` counts finished batches (upstream stores the last batch index, which repeats a batch).

    Args:
        state: the `KerasState` (with a `batch` attribute).

    Returns:
        The callback, for `fit(callbacks=[...])` on every rank.

    Raises:
        AttributeError: (when training begins) the state has no `batch` attribute.

    Example:

    ```python
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state)]
    ```
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._skip = 0

    def on_train_begin(self, logs=None):
        self._skip = int(self.state.batch)
        self._first_epoch = True

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps")
        if self._first_epoch and self._skip and steps:
            # Run only the batches this epoch has left: Keras 3 fixes the epoch's length before it starts, so
            # stop it early (on_train_batch_end) and let the next epoch begin normally.
            self._remaining = max(steps - self._skip, 0)
        else:
            self._remaining = None
            self.state.batch = 0
        self._done_here = 0

    def on_train_batch_end(self, batch, logs=None):
        self._done_here += 1
        self.state.batch = (self._skip if self._first_epoch else 0) + self._done_here
        steps = self.params.get("steps")
        if steps and self.state.batch >= steps:
            # The epoch's last batch: count the epoch as done now, before this batch's commit. A reset raised
            # by that commit (a host update) would otherwise resume with every batch of the epoch done and
            # one more batch to run than the epoch has.
            self.state.batch = 0
            if hasattr(self.state, "epoch"):
                self.state.epoch += 1
        if self._remaining is not None and self._done_here >= self._remaining:
            self.model._lms_end_epoch_early = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self.model, "_lms_end_epoch_early", False):
            # Only this epoch was cut short: training goes on.
            self.model._lms_end_epoch_early = False
            self.model.stop_training = False
        self._first_epoch = False
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` = the epochs finished over all resets (upstream's callback).

    Works with upstream's `fit(epochs=N - state.epoch)` and with `fit(epochs=N, initial_epoch=state.epoch)` (which
    keeps learning-rate schedules on the absolute epoch).

    Args:
        state: the `KerasState` (with an `epoch` attribute).

    Returns:
        The callback, for `fit(callbacks=[...])` on every rank.

    Raises:
        AttributeError: (when training begins) the state has no `epoch` attribute.

    Example:

    ```python
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state)]
    ```
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)
        self._offset = None

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:
            # Upstream's style, fit(epochs=N - state.epoch), numbers this run's epochs from 0; fit(epochs=N,
            # initial_epoch=state.epoch) numbers them from state.epoch. The first epoch index tells which.
            self._offset = self.initial_epoch - epoch

    def on_epoch_end(self, epoch, logs=None):
        offset = self.initial_epoch if self._offset is None else self._offset
        self.state.epoch = offset + epoch + 1


