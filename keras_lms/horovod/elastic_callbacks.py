"""Upstream Horovod's three elastic Keras callbacks on Keras 3: commit the state, and keep its batch and epoch.

Why not upstream's: `UpdateBatchStateCallback` shortens a resumed epoch by editing `params["steps"]`, which Keras 3
ignores, and resumes `state.batch` batches into the epoch, which is the index of the last batch done (a batch would
run twice). These keep upstream's names, arguments and the values of `state.batch` and `state.epoch` in every hook
(horovod/_keras/elastic.py, 0.28.1); give them the `KerasState` (`keras_lms.horovod.elastic_state`) and pass them to
`fit` on every rank.

Note: [Resume point]. Upstream's `state.batch` (the index of the last batch done, 0 again at the epoch end) cannot
tell "batch 0 done" from "no batch done", nor "every batch done, the epoch end still to come" from "one batch
left". So `UpdateBatchStateCallback` keeps one more committed attribute in the state, `_lms_epoch_progress` =
`(epoch, batches done, all done)` for the epoch `state.epoch` named when it was written, and a resume reads that.
When a reset comes after the epoch's last batch but before `state.epoch` moved on (the last batch's commit raised
it, or the epoch-end commit of a callback listed before `UpdateEpochStateCallback`), the epoch counts as finished:
`_settle_finished_epoch` (called by `hvd.elastic.run` before each call of the training function, and when training
begins) advances `state.epoch` and sets `state.batch` to 0, so the resumed `fit` neither repeats a batch nor runs
one that the epoch does not have. The `on_epoch_end` hooks of that epoch do not run again.
"""

from __future__ import annotations

import keras

PROGRESS = "_lms_epoch_progress"


def _track_progress(state) -> None:
    """Make `state._lms_epoch_progress` part of what the state commits, restores and broadcasts."""
    saved = getattr(state, "_saved_state", None)  # Horovod's ObjectState (and our KerasState): the committed dict
    if isinstance(saved, dict) and PROGRESS not in saved:
        saved[PROGRESS] = None
    if not hasattr(state, PROGRESS):
        setattr(state, PROGRESS, None)


def _epoch_of(state):
    return getattr(state, "epoch", None)


def _batches_done(state) -> int:
    """The batches of epoch `state.epoch` that are done (and committed, after a restore): where a resume starts."""
    progress = getattr(state, PROGRESS, None)
    if progress is None or progress[0] != _epoch_of(state):
        return 0  # nothing recorded for this epoch (a stale record is of an epoch already counted)
    return int(progress[1])


def _settle_finished_epoch(state) -> None:
    """If every batch of epoch `state.epoch` is done, count that epoch as finished: `state.epoch += 1`, batch 0.

    Called by `hvd.elastic.run` before each call of the training function (so that `fit(epochs=N - state.epoch)`
    or `initial_epoch=state.epoch` already see the next epoch) and by `UpdateBatchStateCallback` when training
    begins; does nothing otherwise. See Note: [Resume point].
    """
    progress = getattr(state, PROGRESS, None)
    if progress is None:
        return
    if progress[0] != _epoch_of(state):
        setattr(state, PROGRESS, None)  # the epoch has moved on since
        return
    if progress[2]:
        if hasattr(state, "epoch"):
            state.epoch += 1
        state.batch = 0
        setattr(state, PROGRESS, None)


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
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        """Commit the state (upstream's hook: a subclass may override it, e.g. to count commits)."""
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` = the index of the last batch done in the current epoch, and resume an epoch where it stopped.

    As upstream: `state.batch` is set to the batch's index at each batch end and to 0 at the epoch end. Upstream
    shortens the first epoch after a reset by editing `params["steps"]`, which Keras 3 ignores; here the resumed
    epoch really runs only its remaining batches (the epoch ends early, and `fit` goes on with the next one), and
    it resumes after the last batch done (upstream runs that batch again). The index is counted from the start
    of the epoch, also in a resumed one. The resume point is kept in the state as `_lms_epoch_progress`
    (see Note: [Resume point] in this module).

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
        self._first_epoch = True
        _track_progress(state)

    def on_train_begin(self, logs=None):
        _track_progress(self.state)
        if not hasattr(self.state, "batch"):
            raise AttributeError("UpdateBatchStateCallback: the state has no `batch` attribute; create it with "
                                 "`KerasState(model, batch=0, epoch=0)`.")
        _settle_finished_epoch(self.state)  # hvd.elastic.run did it already; another `run` may not have
        self._skip = _batches_done(self.state)
        self._first_epoch = True

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps")
        if self._first_epoch and self._skip and steps:
            # Run only the batches this epoch has left: Keras 3 fixes the epoch's length before it starts, so
            # stop it early (on_train_batch_end) and let the next epoch begin normally.
            # At least one: Keras 3 runs a batch in every epoch (`steps` may also have shrunk since, when it
            # depends on the number of ranks).
            self._remaining = max(steps - self._skip, 1)
        else:
            self._remaining = None
            self._skip = 0
        self._epoch = _epoch_of(self.state)
        self._done_here = 0

    def on_train_batch_end(self, batch, logs=None):
        self._done_here += 1
        done = self._skip + self._done_here
        steps = self.params.get("steps")
        self.state.batch = done - 1  # upstream: the batch's index
        # Committed with the batch: a resume starts after it, and one after the last batch starts a new epoch.
        setattr(self.state, PROGRESS, (self._epoch, done, bool(steps) and done >= steps))
        if self._remaining is not None and self._done_here >= self._remaining:
            self.model._lms_end_epoch_early = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self.model, "_lms_end_epoch_early", False):
            # Only this epoch was cut short: training goes on.
            self.model._lms_end_epoch_early = False
            self.model.stop_training = False
        # Every batch of the epoch is done; until `state.epoch` moves on (UpdateEpochStateCallback, listed before
        # or after this one), a resume starts the next epoch.
        setattr(self.state, PROGRESS, (self._epoch, self._skip + self._done_here, True))
        self._first_epoch = False
        self._skip = 0
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` = the epochs finished over all resets (upstream's callback).

    As upstream, `state.epoch` moves on in `on_epoch_end`: callbacks listed before this one read the epoch that
    just ended there, those after it the next one.

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


