"""Elastic training on Keras 3: upstream Horovod's `hvd.elastic` names, built on Horovod's own state machinery.

Why not `horovod.tensorflow.keras.elastic`: its `TensorFlowKerasState` calls Keras 2 APIs (`optimizer.variables()`
as a method, `tf.keras.backend`), its `run` only recognises a failed `HorovodAllreduce`/`HorovodAllgather`/
`HorovodBroadcast` (our gradients go through `HorovodGroupedAllreduce`, so a peer's death crashed the job), and
nothing retraces the compiled step, which fixed the world size when it was traced.

What is the same as upstream (so its elastic Keras example runs with `import keras_lms.horovod as hvd`): `run`,
`KerasState` / `TensorFlowKerasState` (subclasses of Horovod's `ObjectState`, so `commit`, `check_host_updates`,
`register_reset_callbacks` and the driver's host-change notices are Horovod's own code), and the three callbacks.
What a commit holds (a host copy in memory, never a file): the model's variables (weights, BatchNorm moving
statistics, Dropout seed-generator states), the optimizer's variables (slots, iteration count, loss scale), our
`DistributedOptimizer`'s aggregation buffers and counter, the wrapped model's offload plan and the user's
attributes (`batch`, `epoch`, ...). See docs/horovod.md, "Elastic training".
"""

from __future__ import annotations

import functools

import keras
import numpy as np
from horovod.common import elastic as _common
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.tensorflow.functions import broadcast_object

from . import runtime
from ._hvd import hvd, tf
from .averaging import _DistributedMixin
from .callbacks import broadcast_variables

ObjectState = _common.ObjectState
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


class KerasState(ObjectState):
    """The state of a (wrapped or plain) Keras 3 model and its optimizer, committed in host memory.

    Upstream's `hvd.elastic.KerasState` for Keras 3. `commit()` copies every variable to host memory (a NumPy
    copy, no file), then checks for host updates; `restore()` puts the last commit back; `sync()` builds the
    optimizer if needed (Keras 3 optimizers create their variables lazily, and a joining worker must have the
    same list as the others or the broadcast deadlocks), broadcasts everything from rank 0 and commits. After a
    reset the compiled steps are dropped, so that the next `fit` retraces them for the new number of ranks, and
    a wrapped model re-plans its offload (the per-rank batch or the ranks on this node may have changed).

    Args:
        model: a built `keras.Model` or `keras_lms.wrap`-ped model.
        optimizer: the optimizer; defaults to `model.optimizer` (compile the model first).
        **kwargs: user attributes to keep in the state, e.g. `batch=0, epoch=0` (any picklable values).

    Returns:
        The state; pass it to a function decorated with `run` and to the callbacks.

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: the model is not built, or there is no optimizer.

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
    state.sync()  # builds the optimizer, takes rank 0's state, commits
    committed = model.get_weights()
    model.set_weights([w + 1 for w in committed])  # uncommitted changes ...
    state.batch = 5
    state.restore()  # ... undone, as after a lost rank
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed)) and state.batch == 0
    ```
    """

    def __init__(self, model, optimizer=None, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError("KerasState needs a keras.Model (plain or keras_lms.wrap-ped); "
                            f"got {type(model).__name__}.")
        if not model.built:
            raise ValueError("Model must be built first: call model.build(input_shape) or train one step "
                             "before creating the KerasState.")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("KerasState needs an optimizer: compile the model first, or pass optimizer=.")
        self.model = model
        self.optimizer = optimizer
        self._saved_values = None
        self._saved_plan = None
        self._take_snapshot()
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **kwargs)

    # ------------------------------------------------------------------------------------- variables
    def _ensure_optimizer_built(self) -> None:
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def tracked_variables(self) -> list:
        """Every variable a commit holds, in an order that is the same on every rank."""
        seen, out = set(), []
        distributed = _distributed(self.optimizer)
        # DistributedOptimizer's aggregation buffers and counter are plain tf.Variables Keras does not track.
        extra = [] if distributed is None else [
            v for v in list(distributed._hvd_accumulators or []) + [distributed._hvd_counter] if v is not None]
        for v in list(self.model.variables) + list(self.optimizer.variables) + extra:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    def _take_snapshot(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self.tracked_variables()]
        self._saved_plan = _plan_of(self.model)

    def _put_snapshot_back(self) -> None:
        variables = self.tracked_variables()
        if len(variables) != len(self._saved_values):  # the optimizer was built after the last commit
            self._ensure_optimizer_built()
            variables = self.tracked_variables()
        if len(variables) != len(self._saved_values):
            raise RuntimeError(
                f"KerasState.restore(): the model and optimizer now have {len(variables)} variables, the last commit "
                f"holds {len(self._saved_values)}. Variables were added after the commit (a layer built late, or the "
                "optimizer replaced); commit again after building them.")
        for v, value in zip(variables, self._saved_values):
            v.assign(value)
        _set_plan(self.model, self._saved_plan)

    # ------------------------------------------------------------------------ Horovod's State hooks
    def save(self):
        self._take_snapshot()
        super().save()

    def restore(self):
        self._put_snapshot_back()
        super().restore()

    def sync(self):
        self._ensure_optimizer_built()
        if hvd.size() > 1:
            broadcast_variables(self.tracked_variables(), root_rank=0)
        self._take_snapshot()
        super().sync()

    def reset(self):
        """After Horovod re-formed the job: retrace the steps (the world size is traced in) and re-plan."""
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        distributed = _distributed(self.optimizer)
        if distributed is not None and "_hvd_structure" in vars(distributed):
            object.__delattr__(distributed, "_hvd_structure")  # the end-of-epoch marker's shapes: re-learnt
        _forget_plans(self.model)


TensorFlowKerasState = KerasState


def _distributed(optimizer):
    """Our DistributedOptimizer inside `optimizer` (itself, or the inner one of a LossScaleOptimizer), or None."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if isinstance(candidate, _DistributedMixin):
            return candidate
    return None


def _plan_of(model):
    plans = getattr(model, "_plans", None)
    return None if plans is None else (dict(plans), getattr(model, "_last_plan", None))


def _set_plan(model, saved) -> None:
    if saved is not None and hasattr(model, "_plans"):
        model._plans = dict(saved[0])
        model._last_plan = saved[1]


def _forget_plans(model) -> None:
    if hasattr(model, "_plans"):
        model._plans = {}


# ------------------------------------------------------------------------------------------ callbacks
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
