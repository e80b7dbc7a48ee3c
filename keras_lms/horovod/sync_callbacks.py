"""The callbacks that keep the ranks in step: the same starting weights, and epoch logs averaged over ranks.

Keras 3 re-implementations of Horovod's `BroadcastGlobalVariablesCallback` and `MetricAverageCallback` (Horovod's
own call Keras 2 APIs; see `keras_lms.horovod.callbacks`), with Horovod's names, arguments and formulas. Both run
collectives, so both check that every rank runs the same number of steps (`collective_callback`).
"""

from __future__ import annotations

import numbers

import keras
import numpy as np

from ._hvd import hvd, tf
from .collective_callback import _CollectiveCallback, check_device
from .ops import broadcast_variables


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

    _steps_check_name = "keras_lms_steps_check_broadcast"

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = int(root_rank)
        self.device = check_device(device)
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


def _variable_id(v) -> int:
    """Identity of a Keras or TensorFlow variable (a keras.Variable wraps a tf.Variable in `.value`)."""
    return id(v.value) if isinstance(v, keras.Variable) else id(v)


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

    _steps_check_name = "keras_lms_steps_check_metric_average"

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = check_device(device)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
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
