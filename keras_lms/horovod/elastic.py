"""Elastic training on Keras 3: upstream Horovod's `hvd.elastic` names, built on Horovod's own state machinery.

Why not `horovod.tensorflow.keras.elastic`: its `run` only recognises a failed `HorovodAllreduce`/`HorovodAllgather`/
`HorovodBroadcast` (our gradients go through `HorovodGroupedAllreduce`, so a peer's death crashed the job), its
`TensorFlowKerasState` calls Keras 2 APIs, and nothing retraces the compiled step, which fixed the world size when
it was traced.

This module has `run`, which recovers from a lost rank or a host update. The state (`KerasState`, and what a
commit holds) is in `elastic_state`, the commit/batch/epoch callbacks in `elastic_callbacks`; all are here under
upstream's names, so upstream's elastic Keras example runs with `import keras_lms.horovod as hvd`. See
docs/horovod.md, "Elastic training".
"""

from __future__ import annotations

import functools

from horovod.common import elastic as _common
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from . import runtime
from ._hvd import hvd, tf
from .elastic_callbacks import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    _settle_finished_epoch,
)
from .elastic_state import KerasState, ObjectState, TensorFlowKerasState

State = _common.State


def is_collective_failure(error: BaseException) -> bool:
    """True for the TensorFlow error a Horovod collective raises when the job lost a rank.

    The step-count check of `DistributedOptimizer` (an `InvalidArgumentError` from `assert_near`) is a user
    error, not a lost peer, and is not matched.
    """
    if not isinstance(error, tf.errors.OpError) or isinstance(error, tf.errors.InvalidArgumentError):
        return False
    # The message names the Horovod op that failed, or says Horovod's background loop has stopped.
    return "horovod" in (error.message or "").lower()


def run(func):
    """Decorator: run `func(state, ...)` again after every reset, as upstream's `hvd.elastic.run`.

    `func` is called with the `State` first. A rank that leaves or dies makes the collective of the others fail:
    that TensorFlow error becomes Horovod's `HorovodInternalError`, upon which the state is restored to its last
    commit, Horovod is re-initialised with the ranks that remain (and any that joined), the state is broadcast from
    rank 0, and `func` runs again. A host-update notice (`HostsUpdatedInterrupt`, from `state.commit()` or
    `state.check_host_updates()`) does the same without the restore. Collectives must not run in `func` before
    its training starts (the same rule as upstream's).

    Args:
        func: the training function; its first argument is the `KerasState` (or another Horovod `State`).

    Returns:
        The wrapped function: call it with the state, e.g. `train(state)`.

    Raises:
        Whatever `func` raises that is not a lost rank or a host update.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms
    import keras_lms.horovod as hvd

    hvd.init()
    model = keras_lms.wrap(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse", jit_compile=False)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: model.optimizer.learning_rate.assign(1e-3 * hvd.size())])

    @hvd.elastic.run
    def train(state):
        x, y = np.zeros((8, 4)), np.zeros((8, 1))  # build the rank's shard here: rank and size change at resets
        return model.fit(x, y, batch_size=4, epochs=2, initial_epoch=state.epoch, verbose=0, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state)])

    train(state)
    assert state.epoch == 2 and state.batch == 0
    ```
    """

    @functools.wraps(func)
    def recognising_lost_ranks(state, *args, **kwargs):
        # A reset after an epoch's last batch, before `state.epoch` moved on: that epoch is finished (Note:
        # [Resume point] in elastic_callbacks), so the training function already sees the next one.
        _settle_finished_epoch(state)
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if is_collective_failure(error):
                raise HorovodInternalError(error) from error
            raise

    return _common.run_fn(recognising_lost_ranks, _reset)


def _reset() -> None:
    """Re-form the job: shut Horovod down and initialise it again with the ranks the driver now lists."""
    hvd.shutdown()
    hvd.init()
    runtime.refresh_after_reset()


__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "is_collective_failure",
    "run",
]
