"""Data-parallel training with Horovod for Keras 3 (TensorFlow backend), LMS-wrapped models included.

Usage (launch with ``horovodrun -np N python train.py`` or ``mpirun -np N python train.py``)::

    import keras, keras_lms
    import keras_lms.horovod as lhvd

    lhvd.init()                                    # before building any model (pins GPU, host memory)
    model = keras_lms.wrap(build_model())
    model.compile(optimizer=lhvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * lhvd.size())),
                  loss="mse", jit_compile=False)
    callbacks = [lhvd.BroadcastGlobalVariablesCallback(0), lhvd.MetricAverageCallback(),
                 lhvd.LearningRateWarmupCallback(initial_lr=0.01 * lhvd.size(), warmup_epochs=2)]
    callbacks += lhvd.rank0_only([keras.callbacks.ModelCheckpoint("ckpt.keras")])
    model.fit(shard_of_data, callbacks=callbacks, verbose=lhvd.fit_verbose(1))

Why not ``horovod.tensorflow.keras``: on Keras 3 its DistributedOptimizer silently skips the averaging
(Keras 3 calls ``optimizer.apply`` directly) and its callbacks raise. This package is built only on
``horovod.tensorflow`` core ops. See docs/horovod.md.

Importing it without a working Horovod raises ImportError naming ``make install`` /
``scripts/install_horovod.sh``.
"""

from ._hvd import _INSTALL_HINT  # noqa: F401  (raises ImportError with install instructions first)
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_variables,
)
from .optimizer import DistributedOptimizer, is_distributed, load_model
from .runtime import (
    HorovodInfo,
    fit_verbose,
    info,
    init,
    is_root,
    local_rank,
    local_size,
    rank,
    rank0_only,
    size,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedOptimizer",
    "HorovodInfo",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "broadcast_variables",
    "fit_verbose",
    "info",
    "init",
    "is_distributed",
    "is_root",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "rank0_only",
    "size",
]
