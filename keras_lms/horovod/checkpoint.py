"""Horovod's `BestModelCheckpoint` on Keras 3: save the best model, from the root rank only.

Why a class and not `rank0_only([ModelCheckpoint(...)])`: Horovod scripts use this name, with Horovod's argument
order, and may give it to every rank.
"""

from __future__ import annotations

import keras

from ._hvd import hvd


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
