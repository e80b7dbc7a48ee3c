"""Horovod's learning-rate callbacks on Keras 3: a schedule by epoch, and the gradual warm-up of Goyal et al.

Why not Horovod's: they set `optimizer.lr` through `keras.backend.set_value` (gone in Keras 3) and scale the
momentum *coefficient* for one batch, which a compiled Keras 3 step has baked in as a constant. These keep
Horovod's arguments and formulas, set the learning-rate variable, and correct momentum by scaling the momentum
buffers instead (`_momentum_buffers`).
"""

from __future__ import annotations

import keras

from .. import _keras_adapter as adapter
from ._hvd import hvd


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
