"""The base of the callbacks that run Horovod collectives, and the check that keeps them from hanging.

Why a base class: a callback that runs a collective must run on every rank (rank 0 alone would wait forever for
the others), so `rank0_only` refuses it by its `_hvd_collective` flag; and with a DistributedOptimizer every
training step is an allreduce, so every rank must also run the same number of steps. The base checks that at
train begin (`check_steps_agree`) and, when the counts are unknown up front, at every epoch end
(`end_of_epoch_marker`), so that a badly sharded job fails with a message on every rank instead of hanging.
"""

from __future__ import annotations

import keras

from ._hvd import hvd, tf


class _CollectiveCallback(keras.callbacks.Callback):
    """A callback that runs Horovod collectives: every rank must have it (`rank0_only` refuses it).

    Subclasses name their step-count allgather (`_steps_check_name`: the names must differ between callbacks,
    which all check at train begin) and call `super().on_epoch_end` before their own epoch-end collectives.
    """

    _hvd_collective = True
    _steps_check_name = "keras_lms_steps_check"

    def on_train_begin(self, logs=None):
        self._steps_known = check_steps_agree(self.params, self._steps_check_name)

    def on_epoch_end(self, epoch, logs=None):
        end_of_epoch_marker(self, epoch)


def check_device(device) -> str:
    """`device` as Horovod takes it: a device string, `""` (also for None) for Horovod's choice."""
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
