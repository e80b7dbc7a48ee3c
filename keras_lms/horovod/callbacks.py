"""Keras 3 callbacks for Horovod training, on ``hvd.broadcast`` / ``hvd.allreduce`` only.

Why not ``horovod.tensorflow.keras.callbacks``: those target tf.keras 2 and fail on Keras 3 (they call
``optimizer.variables()`` as a method, use ``optimizer.lr`` and ``keras.backend.get_value/set_value``, and
fall back to ``get_session()``). These re-implementations keep Horovod's names, arguments and formulas.

Ordering: Keras calls callbacks in list order, so put :class:`MetricAverageCallback` before callbacks that read
epoch logs (ModelCheckpoint, CSVLogger, EarlyStopping, ReduceLROnPlateau). The ``History`` returned by ``fit``
is appended by Keras after your callbacks and therefore records averaged values.
"""

from __future__ import annotations

import numbers

import keras
import numpy as np

from ._hvd import from_wire, hvd, tf, to_wire


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Overwrite ``variables`` on every rank with their values on ``root_rank`` (by value, in place).

    All broadcasts are issued inside one ``tf.function`` so Horovod can fuse them, with explicit names that
    are identical on every rank (the variable's position in the list).
    """
    variables = list(variables)
    if not variables or hvd.size() == 1:
        return
    values = [to_wire(tf.convert_to_tensor(v)) for v in variables]
    dtypes = [tf.as_dtype(v.dtype) for v in variables]

    @tf.function(autograph=False)
    def _bcast(tensors):
        return [hvd.broadcast(t, root_rank, name=f"keras_lms_broadcast_{i}") for i, t in enumerate(tensors)]

    for var, value, dtype in zip(variables, _bcast(values), dtypes):
        var.assign(from_wire(value, dtype))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from the root rank's weights and optimizer state.

    Broadcasts ``model.weights`` (trainable and non-trainable, e.g. BatchNorm statistics) and
    ``optimizer.variables`` (slots, iteration counter, learning rate) once, at the beginning of the first
    training batch, i.e. after ``fit`` has built the model and before the first update. If the optimizer is not
    built yet it is built first (``optimizer.build(model.trainable_variables)``), so its slots exist and are
    broadcast too. Random-generator state (``SeedGenerator``) is *not* broadcast: ranks keep independent
    dropout/augmentation randomness.

    Use it whenever ranks might not start from identical weights (different seeds, a checkpoint restored on
    rank 0 only).
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = int(root_rank)
        self.broadcast_done = False

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
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric epoch log (``loss``, metrics, ``val_*``) by its mean over all ranks.

    Keras computes metrics on each rank's own data only. At ``on_epoch_end`` this callback allreduces all
    scalar logs in one float64 ``hvd.allreduce`` (keys sorted, so every rank packs the same order) and writes
    the averages back into the same ``logs`` dict, which later callbacks and ``History`` then see.
    Non-numeric entries are left alone. Every rank must log the same keys (they do, for the same model).
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or hvd.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_scalar(v))
        if not keys:
            return
        local = tf.constant([float(np.asarray(logs[k])) for k in keys], dtype=tf.float64)
        # Fixed name: if ranks ever logged different key sets, Horovod reports a shape mismatch instead of
        # waiting forever for a differently named tensor.
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
    if isinstance(inner._learning_rate, keras.optimizers.schedules.LearningRateSchedule) or not isinstance(
        inner._learning_rate, keras.Variable
    ):
        raise ValueError(
            "Learning-rate callbacks need an optimizer created with a float learning_rate (stored as a "
            f"variable); this optimizer uses {type(inner._learning_rate).__name__}. Either pass a float "
            "learning_rate, or use the schedule alone without LearningRateWarmupCallback/"
            "LearningRateScheduleCallback."
        )
    return opt


def _momentum_buffers(opt):
    """Variables holding ``lr``-scaled momentum: SGD ``momentums``, RMSprop ``_momentums``.

    Keras 3 SGD/RMSprop keep the momentum *coefficient* as a Python float that ``fit``'s ``tf.function``
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
        return list(opt._momentums)
    return []


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` for ``start_epoch <= epoch < end_epoch`` (Horovod semantics).

    Args:
        initial_lr: base learning rate (usually already scaled by ``size()``).
        multiplier: a constant ``m`` (exponential decay: ``m ** (epoch - start_epoch)``) or ``fn(epoch)``.
        start_epoch, end_epoch: epochs where the schedule applies (``end_epoch`` exclusive, None = forever).
        staircase: True adjusts once at the first batch of each epoch with the integer epoch; False adjusts at
            every batch with the fractional epoch ``epoch + batch / steps_per_epoch``.
        momentum_correction: when the lr changes, scale SGD/RMSprop momentum buffers by new_lr/old_lr.
        steps_per_epoch: needed with ``staircase=False``; taken from ``fit``'s ``params['steps']`` if None.

    The current learning rate is added to the epoch logs as ``learning_rate``.
    Raises ``ValueError`` at the start of training if the optimizer's learning rate is a
    ``LearningRateSchedule`` (not settable).
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
    """Gradual warm-up (Goyal et al. 2017) from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod 0.28.1's formula, adjusted at the start of every batch of the first ``warmup_epochs`` epochs::

        e  = epoch + batch / steps_per_epoch + 1 / steps_per_epoch
        lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)

    so the last batch of epoch ``warmup_epochs - 1`` runs at exactly ``initial_lr``, which then stays set.
    ``initial_lr`` is the *scaled* rate (e.g. ``0.01 * size()``). With one rank lr is constant.
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
