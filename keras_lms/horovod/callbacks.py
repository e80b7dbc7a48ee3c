"""Keras 3 callbacks for Horovod training, in one namespace (as `horovod.tensorflow.keras.callbacks`).

Why not `horovod.tensorflow.keras.callbacks`: those target tf.keras 2 and fail on Keras 3 (they call
`optimizer.variables()` as a method, use `optimizer.lr` and `keras.backend.get_value/set_value`, and
fall back to `get_session()`). These re-implementations keep Horovod's names, arguments and formulas, and use
`hvd.broadcast` / `hvd.allreduce` only. Where each lives: `sync_callbacks` (broadcast, metric average),
`learning_rate` (schedule, warm-up), `checkpoint` (`BestModelCheckpoint`); `collective_callback` has the
step-count check that the collective ones share.

Ordering: Keras calls callbacks in list order, so put `MetricAverageCallback` before callbacks that read
epoch logs (ModelCheckpoint, CSVLogger, EarlyStopping, ReduceLROnPlateau). The `History` returned by `fit`
is appended by Keras after your callbacks and therefore records averaged values.
"""

from __future__ import annotations

from .checkpoint import BestModelCheckpoint
from .collective_callback import check_steps_agree, end_of_epoch_marker
from .learning_rate import LearningRateScheduleCallback, LearningRateWarmupCallback
from .ops import broadcast_variables
from .sync_callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "broadcast_variables",
    "check_steps_agree",
    "end_of_epoch_marker",
]
