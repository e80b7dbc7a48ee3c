"""Keras 3 callbacks for Horovod training, on `hvd.broadcast` / `hvd.allreduce` only.

Why not `horovod.tensorflow.keras.callbacks`: those target tf.keras 2 and fail on Keras 3 (they call
`optimizer.variables()` as a method, use `optimizer.lr` and `keras.backend.get_value/set_value`, and
fall back to `get_session()`). These re-implementations keep Horovod's names, arguments and formulas.

Ordering: Keras calls callbacks in list order, so put `MetricAverageCallback` before callbacks that read
epoch logs (ModelCheckpoint, CSVLogger, EarlyStopping, ReduceLROnPlateau). The `History` returned by `fit`
is appended by Keras after your callbacks and therefore records averaged values.
"""

from __future__ import annotations

import numbers

import keras
import numpy as np

from .. import _keras_adapter as adapter
from ._hvd import from_wire, hvd, tf, to_wire


def broadcast_variables(variables, root_rank: int = 0, device: str = "") -> None:
    """Overwrite `variables` on every rank with their values on `root_rank` (by value, in place).

    All broadcasts are issued inside one `tf.function` so Horovod can fuse them, with explicit names that
    are identical on every rank (the variable's position in the list). `device`: where the broadcast ops
    are placed (`""`: Horovod's choice).
    """
    variables = list(variables)
    if not variables or hvd.size() == 1:
        return
    values = [to_wire(tf.convert_to_tensor(v)) for v in variables]
    dtypes = [tf.as_dtype(v.dtype) for v in variables]

    @tf.function(autograph=False)
    def _bcast(tensors):
        with tf.device(device or None):
            return [hvd.broadcast(t, root_rank, name=f"keras_lms_broadcast_{i}") for i, t in enumerate(tensors)]

    for var, value, dtype in zip(variables, _bcast(values), dtypes):
        var.assign(from_wire(value, dtype))


def _variable_id(v) -> int:
    """Identity of a Keras or TensorFlow variable (a keras.Variable wraps a tf.Variable in `.value`)."""
    return id(v.value) if isinstance(v, keras.Variable) else id(v)


def _check_device(device) -> str:
    if device is None:
        return ""
    if not isinstance(device, str):
        raise TypeError(f"device must be a device string such as '/cpu:0' (or '' for Horovod's choice); got {device!r}")
    return device


def check_steps_agree(params, name: str) -> bool:
    """Fail on every rank, before the first step, if the ranks would run different numbers of steps.

    With a DistributedOptimizer every training step is an allreduce; a rank with fewer batches per epoch
    leaves the others waiting in a collective it never joins (a hang). `fit`'s `params` know the steps
    per epoch when the data has a length (arrays, `PyDataset`, `tf.data` with known cardinality,
    `steps_per_epoch`); one allgather compares them. Returns True when every rank knows (and they agree);
    unknown lengths (generators) are checked at every epoch end instead (`end_of_epoch_marker`).
    """
    if hvd.size() == 1:
        return True
    params = params or {}
    steps, epochs = params.get("steps"), params.get("epochs")
    local = tf.constant([[-1 if steps is None else int(steps), -1 if epochs is None else int(epochs)]], tf.int64)
    table = hvd.allgather(local, name=name).numpy()
    known = table[:, 0] >= 0
    if known.any() and not known.all():
        raise ValueError(
            "keras_lms.horovod: some ranks know their number of training batches per epoch and others do not "
            f"(batches per rank: {_per_rank(table[:, 0])}). Give every rank the same kind of data (all arrays, "
            "or all tf.data with the same cardinality), or pass the same steps_per_epoch= to fit() on every rank."
        )
    for column, what in ((0, "training batches per epoch"), (1, "epochs")):
        values = table[:, column]
        if known.all() and len(set(values.tolist())) > 1:
            raise ValueError(
                f"keras_lms.horovod: the ranks have different numbers of {what} ({_per_rank(values)}). "
                "Every training step is an allreduce across ranks, so a rank that runs out of data first would "
                "leave the others waiting forever. Shard the data so that every rank gets the same number of "
                "batches: e.g. dataset.shard(lhvd.size(), lhvd.rank()) on a dataset whose length is a multiple "
                "of size() x batch_size, or .batch(batch_size, drop_remainder=True) after sharding, or pass the "
                "same steps_per_epoch= (the smallest count) and epochs= to fit() on every rank."
            )
    return bool(known.all())


def end_of_epoch_marker(callback, epoch) -> None:
    """When the steps per epoch were unknown at train begin: tell the DistributedOptimizer this rank's epoch
    ended (once per epoch, whichever collective callback comes first), so that a rank still training fails
    with a message instead of waiting forever; raises here too in that case."""
    if getattr(callback, "_steps_known", True) or hvd.size() == 1:
        return
    opt = getattr(callback.model, "optimizer", None)
    marker = getattr(opt, "_hvd_end_of_epoch", None)
    if marker is None:
        return
    key = (id(callback.params), epoch)
    if getattr(opt, "_hvd_marked", None) == key:
        return
    object.__setattr__(opt, "_hvd_marked", key)
    marker()


def _per_rank(values) -> str:
    return ", ".join(f"rank {r}: {'unknown' if v < 0 else int(v)}" for r, v in enumerate(values))


class _CollectiveCallback(keras.callbacks.Callback):
    """A callback that runs Horovod collectives: every rank must have it (`rank0_only` refuses it)."""

    _hvd_collective = True


class BroadcastGlobalVariablesCallback(_CollectiveCallback):
    """Make every rank start from the root rank's weights and optimizer state.

    Broadcasts `model.weights` (trainable and non-trainable, e.g. BatchNorm statistics) and
    `optimizer.variables` (slots, iteration counter, learning rate) once, at the beginning of the first
    training batch, i.e. after `fit` has built the model and before the first update. If the optimizer is not
    built yet it is built first (`optimizer.build(model.trainable_variables)`), so its slots exist and are
    broadcast too. Random-generator state (`SeedGenerator`) is *not* broadcast: ranks keep independent
    dropout/augmentation randomness.

    At the start of training it also checks that every rank will run the same number of batches per epoch
    and epochs (`check_steps_agree`) and raises `ValueError` on every rank if not, instead of hanging;
    when the counts are unknown up front (generators), it checks at every epoch end
    (`end_of_epoch_marker`).

    Args:
        root_rank: the rank whose values are sent.
        device: where the broadcast ops are placed (`""`: Horovod's choice), as in Horovod.
        local_variables: a variable or list of variables that are *not* broadcast (worker-local state).

    Use it whenever ranks might not start from identical weights (different seeds, a checkpoint restored on
    rank 0 only).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = int(root_rank)
        self.device = _check_device(device)
        self.broadcast_done = False
        self._local_ids: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (keras.Variable, tf.Variable)):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var) -> None:
        """Do not broadcast `var` (Horovod's `register_local_var`)."""
        if not isinstance(var, (keras.Variable, tf.Variable)):
            raise ValueError(f"local variables must be keras.Variable or tf.Variable objects; got {type(var).__name__}")
        self._local_ids.add(_variable_id(var))

    def on_train_begin(self, logs=None):
        self._steps_known = check_steps_agree(self.params, "keras_lms_steps_check_broadcast")

    def on_epoch_end(self, epoch, logs=None):
        end_of_epoch_marker(self, epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        variables = list(model.weights)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        variables = [v for v in variables if _variable_id(v) not in self._local_ids]
        broadcast_variables(variables, self.root_rank, device=self.device)
        self.broadcast_done = True


class MetricAverageCallback(_CollectiveCallback):
    """Replace each numeric epoch log (`loss`, metrics, `val_*`) by its mean over all ranks.

    Keras computes metrics on each rank's own data only. At `on_epoch_end` this callback allreduces all
    scalar logs in one float64 `hvd.allreduce` (keys sorted, so every rank packs the same order) and writes
    the averages back into the same `logs` dict, which later callbacks and `History` then see.
    Non-numeric entries are left alone. Every rank must log the same keys (they do, for the same model).
    Like `BroadcastGlobalVariablesCallback` it checks that every rank runs the same number of batches
    per epoch (at train begin, or at each epoch end before averaging when the counts are unknown up front).

    Args:
        device: where the allreduce is placed (`""`: Horovod's choice), as in Horovod.
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = _check_device(device)

    def on_train_begin(self, logs=None):
        self._steps_known = check_steps_agree(self.params, "keras_lms_steps_check_metric_average")

    def on_epoch_end(self, epoch, logs=None):
        end_of_epoch_marker(self, epoch)
        if logs is None or hvd.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_scalar(v))
        if not keys:
            return
        local = tf.constant([float(np.asarray(logs[k])) for k in keys], dtype=tf.float64)
        # Fixed name: if ranks ever logged different key sets, Horovod reports a shape mismatch instead of
        # waiting forever for a differently named tensor.
        with tf.device(self.device or None):
            avg = hvd.allreduce(local, op=hvd.Average, name="keras_lms_metric_average").numpy()
        for k, v in zip(keys, avg):
            logs[k] = float(v)


def _is_scalar(v) -> bool:
    if isinstance(v, numbers.Number) and not isinstance(v, bool):
        return True
    try:
        a = np.asarray(v)
    except Exception:
        return False
    return a.shape == () and a.dtype.kind in "fiu"


# ----------------------------------------------------------------------------------- learning rate
def _settable_lr_optimizer(model):
    opt = getattr(model, "optimizer", None)
    if opt is None:
        raise ValueError("the model has no optimizer; compile it before fit()")
    inner = getattr(opt, "inner_optimizer", opt)  # LossScaleOptimizer delegates learning_rate
    # A float learning rate is stored in a variable the optimizer tracks, and `learning_rate` returns that very
    # variable; a LearningRateSchedule (or a callable) returns a value computed at each read, which cannot be set.
    lr = inner.learning_rate
    if not (isinstance(lr, keras.Variable) and any(lr is v for v in inner.variables)):
        stored = inner.get_config().get("learning_rate")  # a schedule's config names its class
        name = stored.get("class_name") if isinstance(stored, dict) else None
        kind = name if name not in (None, "function", "__lambda__") else "a callable"
        raise ValueError(
            "Learning-rate callbacks need an optimizer created with a float learning_rate (stored as a variable); "
            f"this optimizer uses {kind}. Either pass a float learning_rate, or use the schedule alone without "
            "LearningRateWarmupCallback/LearningRateScheduleCallback."
        )
    return opt


def _momentum_buffers(opt):
    """Variables holding `lr`-scaled momentum: SGD `momentums`, RMSprop's (`adapter.rmsprop_momentums`).

    Keras 3 SGD/RMSprop keep the momentum *coefficient* as a Python float that `fit`'s `tf.function`
    bakes into the graph, so Horovod's trick (temporarily multiply the coefficient by new_lr/old_lr for one
    batch) cannot work. Scaling the momentum buffers by new_lr/old_lr before the update is mathematically
    the same step (Goyal et al. 2017, sec. 2.1 "momentum correction") and works with compiled steps.
    """
    opt = getattr(opt, "inner_optimizer", opt)
    if not opt.built:  # fit() builds the optimizer inside the first train step: no momentum to correct yet
        return []
    if isinstance(opt, keras.optimizers.SGD) and opt.momentum:
        return list(opt.momentums)
    if isinstance(opt, keras.optimizers.RMSprop) and opt.momentum:
        return adapter.rmsprop_momentums(opt)
    return []


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set `lr = initial_lr * multiplier(epoch)` for `start_epoch <= epoch < end_epoch` (Horovod semantics).

    Args:
        initial_lr: base learning rate (usually already scaled by `size()`).
        multiplier: a constant `m` (exponential decay: `m ** (epoch - start_epoch)`) or `fn(epoch)`.
        start_epoch, end_epoch: epochs where the schedule applies (`end_epoch` exclusive, None = forever).
        staircase: True adjusts once at the first batch of each epoch with the integer epoch; False adjusts at
            every batch with the fractional epoch `epoch + batch / steps_per_epoch`.
        momentum_correction: when the lr changes, scale SGD/RMSprop momentum buffers by new_lr/old_lr.
        steps_per_epoch: needed with `staircase=False`; taken from `fit`'s `params['steps']` if None.

    The current learning rate is added to the epoch logs as `learning_rate`.
    Raises `ValueError` at the start of training if the optimizer's learning rate is a
    `LearningRateSchedule` (not settable).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        old_lr = float(opt.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            ratio = new_lr / old_lr
            for m in _momentum_buffers(opt):
                m.assign(m * ratio)

    def on_train_begin(self, logs=None):
        _settable_lr_optimizer(self.model)
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    f"Could not determine the number of steps per epoch; pass steps_per_epoch to "
                    f"{type(self).__name__}() (or fit(steps_per_epoch=...))."
                )
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al. 2017) from `initial_lr / size` to `initial_lr` over `warmup_epochs`.

    Horovod 0.28.1's formula, adjusted at the start of every batch of the first `warmup_epochs` epochs::

        e  = epoch + batch / steps_per_epoch + 1 / steps_per_epoch
        lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)

    so the last batch of epoch `warmup_epochs - 1` runs at exactly `initial_lr`, which then stays set.
    `initial_lr` is the *scaled* rate (e.g. `0.01 * size()`). With one rank lr is constant.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / hvd.size() * (epoch * (hvd.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model whenever `monitor` improves, on the root rank only (Horovod's `BestModelCheckpoint`).

    Horovod's arguments and order (`monitor='val_loss', verbose=0, save_weights_only=False, mode='auto',
    save_freq='epoch'`); it is `keras.callbacks.ModelCheckpoint(save_best_only=True)`. Horovod leaves the
    path to its Spark/Ray estimators; here pass `filepath=` (a `.keras` file, or `.weights.h5` with
    `save_weights_only`) or set `callback.filepath` before `fit`. Only rank 0 writes (every rank may keep
    the callback: it runs no collective); put it after `MetricAverageCallback` so it compares averaged
    values.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 *, filepath=None, root_rank: int = 0):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder if filepath is None else filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None
        self.root_rank = int(root_rank)

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError(
                "BestModelCheckpoint has no file path: pass BestModelCheckpoint(..., filepath='best.keras') or set "
                "callback.filepath before fit() (Horovod's estimators set it for you; plain Keras does not)."
            )
        super().on_train_begin(logs)

    # ModelCheckpoint saves (and tracks the best value) only from these two hooks; other ranks skip them.
    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == self.root_rank:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == self.root_rank:
            super().on_epoch_end(epoch, logs)
