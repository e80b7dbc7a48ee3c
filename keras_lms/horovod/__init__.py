"""Data-parallel training with Horovod for Keras 3 (TensorFlow backend), LMS-wrapped models included.

Usage (launch with `horovodrun -np N python train.py` or `mpirun -np N python train.py`; a complete script is
examples/quickstart_horovod.py):

```python
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
```

Horovod's Keras names are here too (`allreduce`, `allgather`, `broadcast`, `reducescatter`,
`Average`/`Sum`/`Adasum`, `Compression`, `ProcessSet`, `shutdown`, `cross_rank`, timelines,
`PartialDistributedOptimizer`, `BestModelCheckpoint`), with Horovod's argument order, so a Horovod Keras
script runs with `import keras_lms.horovod as hvd`; docs/horovod.md lists what deliberately differs.

Why not `horovod.tensorflow.keras`: on Keras 3 its DistributedOptimizer silently skips the averaging
(Keras 3 calls `optimizer.apply` directly) and its callbacks raise. This package is built only on
`horovod.tensorflow` core ops. See docs/horovod.md.

Importing it without a working Horovod raises ImportError naming `make install` /
`scripts/install_horovod.sh`.
"""

from ._hvd import _INSTALL_HINT  # noqa: F401 - raises ImportError with install instructions first

# isort: split
from . import elastic  # upstream's `hvd.elastic` (run, KerasState, the elastic callbacks); after the check above
from .callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_variables,
)
from .ops import (
    Adasum,
    Average,
    Compression,
    ProcessSet,
    Sum,
    add_process_set,
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    ccl_built,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_initialized,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    reducescatter,
    remove_process_set,
    rocm_built,
    shutdown,
    start_timeline,
    stop_timeline,
)
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, is_distributed, load_model
from .runtime import (
    HorovodInfo,
    cross_rank,
    cross_size,
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
    "Adasum",
    "Average",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedOptimizer",
    "HorovodInfo",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_variables",
    "elastic",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "fit_verbose",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "info",
    "init",
    "is_distributed",
    "is_initialized",
    "is_root",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rank0_only",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
