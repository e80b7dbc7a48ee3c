"""`state.epoch`/`state.batch` in every callback hook, and resuming after a reset at an epoch's end (issue 29).

In-process, one rank (Horovod initialised without a launcher is a job of size 1): the elastic callbacks and
`hvd.elastic.run` do not need more to show what they write and where a resume starts. A reset is injected the way
the driver announces one: a host-update message queued on the state just before a commit, so that commit raises
`HostsUpdatedInterrupt`, `run` resets the state and calls the training function again. `run`'s re-forming of the job
(`hvd.shutdown(); hvd.init()`) is left out here: in a process that no launcher started, Horovod uses MPI, which
cannot start again once shut down. Re-forming is covered by the multi-rank jobs of test_horovod_elastic.py and
tests/horovod/upstream_elastic.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytestmark = pytest.mark.horovod

STEPS, EPOCHS = 3, 3


@pytest.fixture
def hvd(monkeypatch):
    pytest.importorskip("horovod.tensorflow")
    import keras_lms.horovod as hvd

    # init() sets the per-rank host-memory limit in os.environ when it is unset; keep it out of later launches.
    monkeypatch.setenv("TF_GPU_HOST_MEM_LIMIT_IN_MB", os.environ.get("TF_GPU_HOST_MEM_LIMIT_IN_MB", "1024"))
    hvd.init()
    from keras_lms.horovod import elastic, runtime

    monkeypatch.setattr(elastic, "_reset", runtime.refresh_after_reset)  # the same single rank (module docstring)
    return hvd


def make_state(hvd):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
    return hvd.elastic.KerasState(model, batch=0, epoch=0)


def data():
    x = np.arange(STEPS * 4 * 2, dtype="float32").reshape(-1, 2) / 10
    return x, x.sum(axis=1, keepdims=True)


# ------------------------------------------------------------------------- values read in each hook
# Upstream Horovod 0.28.1, horovod/_keras/elastic.py, read line by line, for fit(epochs=EPOCHS, steps=STEPS) from
# KerasState(batch=0, epoch=0) and upstream's callback order [UpdateEpochState, UpdateBatchState, CommitState]:
# * UpdateEpochStateCallbackImpl.on_epoch_end: `state.epoch = self.initial_epoch + epoch + 1` (initial_epoch = 0);
#   no other hook of any of the three callbacks writes `state.epoch`.
# * UpdateBatchStateCallbackImpl.on_epoch_begin writes only `params['steps']`; on_batch_end (Keras calls it from
#   on_train_batch_end): `state.batch = batch`; on_epoch_end: `state.batch = 0`.
# * CommitStateCallbackImpl only commits (no attribute changes).
# So a callback listed before the three reads, in epoch e and batch b:
#   on_epoch_begin (e, 0); on_train_batch_end (e, b - 1), at b = 0 the 0 left by the previous on_epoch_end (or the
#   initial 0); on_epoch_end (e, STEPS - 1);
# and one listed after them: on_epoch_begin (e, 0); on_train_batch_end (e, b); on_epoch_end (e + 1, 0).
UPSTREAM = {
    "before": [
        ("on_epoch_begin", 0, None, 0, 0),
        ("on_train_batch_end", 0, 0, 0, 0), ("on_train_batch_end", 0, 1, 0, 0), ("on_train_batch_end", 0, 2, 0, 1),
        ("on_epoch_end", 0, None, 0, 2),
        ("on_epoch_begin", 1, None, 1, 0),
        ("on_train_batch_end", 1, 0, 1, 0), ("on_train_batch_end", 1, 1, 1, 0), ("on_train_batch_end", 1, 2, 1, 1),
        ("on_epoch_end", 1, None, 1, 2),
        ("on_epoch_begin", 2, None, 2, 0),
        ("on_train_batch_end", 2, 0, 2, 0), ("on_train_batch_end", 2, 1, 2, 0), ("on_train_batch_end", 2, 2, 2, 1),
        ("on_epoch_end", 2, None, 2, 2),
    ],
    "after": [
        ("on_epoch_begin", 0, None, 0, 0),
        ("on_train_batch_end", 0, 0, 0, 0), ("on_train_batch_end", 0, 1, 0, 1), ("on_train_batch_end", 0, 2, 0, 2),
        ("on_epoch_end", 0, None, 1, 0),
        ("on_epoch_begin", 1, None, 1, 0),
        ("on_train_batch_end", 1, 0, 1, 0), ("on_train_batch_end", 1, 1, 1, 1), ("on_train_batch_end", 1, 2, 1, 2),
        ("on_epoch_end", 1, None, 2, 0),
        ("on_epoch_begin", 2, None, 2, 0),
        ("on_train_batch_end", 2, 0, 2, 0), ("on_train_batch_end", 2, 1, 2, 1), ("on_train_batch_end", 2, 2, 2, 2),
        ("on_epoch_end", 2, None, 3, 0),
    ],
}


def probe(state, rows):
    """A callback that appends (hook, Keras epoch, Keras batch, state.epoch, state.batch) to `rows`."""
    import keras

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            rows.append(("on_epoch_begin", epoch, None, state.epoch, state.batch))

        def on_train_batch_end(self, batch, logs=None):
            rows.append(("on_train_batch_end", self._epoch, batch, state.epoch, state.batch))

        def on_epoch_end(self, epoch, logs=None):
            rows.append(("on_epoch_end", epoch, None, state.epoch, state.batch))

    return Probe()


def hook_values(hvd, batch_callback=None):
    state = make_state(hvd)
    before, after = [], []
    x, y = data()
    update_batch = (batch_callback or hvd.elastic.UpdateBatchStateCallback)(state)
    state.model.fit(x, y, batch_size=len(x) // STEPS, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[
        probe(state, before), hvd.elastic.UpdateEpochStateCallback(state), update_batch,
        hvd.elastic.CommitStateCallback(state), probe(state, after)])
    return {"before": before, "after": after}


def test_state_epoch_and_batch_read_in_each_hook_match_upstream(hvd):
    assert hook_values(hvd) == UPSTREAM


def test_control_epoch_moved_at_the_last_batch_is_caught(hvd):
    """Negative control: the previous UpdateBatchStateCallback (the epoch counted as done at its last
    batch, `state.batch` counting batches) reads other values than upstream's in on_train_batch_end and
    on_epoch_end."""

    class Old(hvd.elastic.UpdateBatchStateCallback):
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            self.state.batch += 1
            if self.state.batch >= self.params["steps"]:
                self.state.batch = 0
                self.state.epoch += 1

    got = hook_values(hvd, Old)
    assert got != UPSTREAM
    assert ("on_epoch_end", 0, None, 1, 0) in got["before"]  # the issue: on_epoch_end saw the next epoch already
    assert ("on_train_batch_end", 0, 1, 0, 2) in got["after"]


# ------------------------------------------------------------------------- resets at an epoch's end
def train_with_reset(hvd, at, order="upstream"):
    """Train EPOCHS x STEPS under `hvd.elastic.run`, with one reset raised by the commit `at` names:
    ("last_batch", e) the commit after epoch e's last batch, ("epoch_end", e) the commit at epoch e's end.
    Returns {epoch: batches run for it} (the epoch a batch belongs to is the one the training function started
    `fit` from, plus Keras' epoch index), the epochs the training function started from, the optimizer's final
    iteration count and the final (state.epoch, state.batch)."""
    import keras
    from horovod.runner.elastic.worker import HostUpdateResult

    state = make_state(hvd)
    x, y = data()
    starts = []
    counts = {}
    fired = []

    class Count(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = self.first + epoch

        def on_train_batch_end(self, batch, logs=None):
            counts[self.epoch] = counts.get(self.epoch, 0) + 1

    class HostsChange(keras.callbacks.Callback):
        """Queues a host-update notice just before the named commit (listed just before CommitStateCallback)."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = counter.epoch

        def _notify(self, where, batch=None):
            if not fired and (where, self.epoch) == at and (batch is None or batch == STEPS - 1):
                fired.append(True)
                state.on_hosts_updated(time.time(), HostUpdateResult.added)

        def on_train_batch_end(self, batch, logs=None):
            self._notify("last_batch", batch)

        def on_epoch_end(self, epoch, logs=None):
            self._notify("epoch_end")

    counter = Count()
    update_epoch = hvd.elastic.UpdateEpochStateCallback(state)
    update_batch = hvd.elastic.UpdateBatchStateCallback(state)
    commit = hvd.elastic.CommitStateCallback(state)
    if order == "upstream":  # upstream's example and test script
        callbacks = [counter, update_epoch, update_batch, HostsChange(), commit]
    else:  # the commit between the two update callbacks: its epoch-end commit sees the ended epoch
        callbacks = [counter, update_batch, HostsChange(), commit, update_epoch]

    @hvd.elastic.run
    def train(state):
        counter.first = state.epoch
        starts.append(state.epoch)
        state.model.fit(x, y, batch_size=len(x) // STEPS, epochs=EPOCHS - state.epoch, verbose=0, shuffle=False,
                        callbacks=callbacks)

    train(state)
    assert fired, "the reset was not injected"
    return counts, starts, int(state.optimizer.iterations.numpy()), (state.epoch, state.batch)


EVERY_BATCH_ONCE = {e: STEPS for e in range(EPOCHS)}


@pytest.mark.parametrize("order", ["upstream", "commit_before_epoch_update"])
def test_reset_raised_by_the_last_batch_commit_repeats_and_skips_nothing(hvd, order):
    counts, starts, iterations, final = train_with_reset(hvd, ("last_batch", 1), order)
    assert starts == [0, 2], starts  # one reset, and the resumed run started at the next epoch
    assert counts == EVERY_BATCH_ONCE, counts
    assert iterations == EPOCHS * STEPS and final == (EPOCHS, 0)


@pytest.mark.parametrize("order", ["upstream", "commit_before_epoch_update"])
def test_reset_raised_by_the_epoch_end_commit_repeats_and_skips_nothing(hvd, order):
    counts, starts, iterations, final = train_with_reset(hvd, ("epoch_end", 1), order)
    assert starts == [0, 2], starts
    assert counts == EVERY_BATCH_ONCE, counts
    assert iterations == EPOCHS * STEPS and final == (EPOCHS, 0)


def test_control_last_batch_reset_without_the_finished_epoch_rule_runs_a_batch_twice(hvd, monkeypatch):
    """Negative control: a resume that reads only the batch state (the epoch whose batches are all done is not
    counted as finished, as when `state.epoch` moves only at the epoch end and nothing else is recorded) runs
    the resumed epoch once more for one batch: the check above sees the repeat."""
    from keras_lms.horovod import elastic, elastic_callbacks

    monkeypatch.setattr(elastic, "_settle_finished_epoch", lambda state: None)
    monkeypatch.setattr(elastic_callbacks, "_settle_finished_epoch", lambda state: None)
    counts, _, iterations, _ = train_with_reset(hvd, ("last_batch", 1))
    assert counts != EVERY_BATCH_ONCE and counts[1] == STEPS + 1, counts
    assert iterations == EPOCHS * STEPS + 1


def test_control_epoch_end_reset_with_a_finished_epoch_rule_blind_to_the_epoch_skips_one(hvd, monkeypatch):
    """Negative control: a resume that counts an epoch as finished whenever the batch state says "all batches
    done", without checking that the record is of the current `state.epoch` (at the epoch-end commit
    UpdateEpochStateCallback has already moved on), finishes the next epoch too: its batches are skipped."""
    from keras_lms.horovod import elastic, elastic_callbacks

    def blind(state):
        progress = getattr(state, elastic_callbacks.PROGRESS, None)
        if progress is not None and progress[2]:
            state.epoch, state.batch = state.epoch + 1, 0
            setattr(state, elastic_callbacks.PROGRESS, None)

    monkeypatch.setattr(elastic, "_settle_finished_epoch", blind)
    monkeypatch.setattr(elastic_callbacks, "_settle_finished_epoch", blind)
    counts, _, iterations, _ = train_with_reset(hvd, ("epoch_end", 1))
    assert counts != EVERY_BATCH_ONCE and 2 not in counts, counts
    assert iterations == (EPOCHS - 1) * STEPS
