"""Runtime and model of the segmentation examples: Horovod set-up, seeds, and the compiled (wrapped) U-Net.

:func:`setup_runtime` places this process in the job (:class:`Runtime`); :func:`build_model` builds the U-Net of
``examples/unet.py`` (or loads a checkpoint), wraps it with ``keras_lms.wrap`` as the flags say
(:func:`wrap_kwargs`) and compiles it with the loss and metrics of :mod:`examples.metrics`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import keras
import numpy as np

import keras_lms

if __package__:  # imported as examples.runtime (python -m examples.segmentation_3d, the tests)
    from .cli import Task
    from .metrics import Dice, DiceBCELoss, IoU
    from .state import STATE, ResumeError
    from .unet import build_unet
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from cli import Task
    from metrics import Dice, DiceBCELoss, IoU
    from state import STATE, ResumeError
    from unet import build_unet


@dataclasses.dataclass
class Runtime:
    """Where this process sits in the job; ``hvd`` is the ``keras_lms.horovod`` module or None."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    hvd: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def log(self, *parts) -> None:
        if self.is_root:
            print(*parts, flush=True)


def setup_runtime(args) -> Runtime:
    """Horovod first (it pins the GPU and sizes threads/host memory before TensorFlow starts), then seeds."""
    rt = Runtime()
    if args.horovod:
        import keras_lms.horovod as lhvd

        lhvd.init()
        rt = Runtime(rank=lhvd.rank(), size=lhvd.size(), local_rank=lhvd.local_rank(), hvd=lhvd)
    if args.mixed_precision:
        keras.mixed_precision.set_dtype_policy("mixed_float16")
    # The same seed on every rank: identical initial weights (the broadcast makes sure anyway).
    keras.utils.set_random_seed(args.seed)
    return rt


def broadcast_int(rt: Runtime, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if rt.size == 1:
        return int(value)
    var = keras.Variable(np.array([value], "int64"), trainable=False, name="broadcast_int")
    rt.hvd.broadcast_variables([var], root_rank=0)
    return int(keras.ops.convert_to_numpy(var)[0])

def wrap_kwargs(args) -> dict:
    kwargs = {}
    for flag, key in (("min_bytes", "min_bytes"), ("keep_last", "keep_last"), ("prefetch", "prefetch"),
                      ("slab_bytes", "slab_bytes"), ("budget", "device_budget")):
        value = getattr(args, flag)
        if value is not None:
            kwargs[key] = int(value) if isinstance(value, str) and value.isdigit() else value
    return kwargs


def build_model(args, task: Task, channels: int, rt: Runtime, restore: pathlib.Path | None = None):
    """``(model, base)``: the compiled (possibly wrapped) model and the plain U-Net (weights shared).

    With ``restore`` the checkpoint's weights and optimizer state are loaded; the keras-lms settings and the
    distributed optimizer follow the current flags, so a run may be resumed with other ``--lms`` settings.
    """
    if restore is not None:
        try:
            loaded = keras.saving.load_model(restore)
        except Exception as err:  # any failure to read it means the same thing to the user
            raise ResumeError(f"--resume: {restore} cannot be loaded ({type(err).__name__}: {err}). Delete it and "
                              f"{restore.with_name(STATE)} to start over.") from err
        base = keras_lms.unwrap(loaded) if isinstance(loaded, keras_lms.LMSModel) else loaded
        optimizer = loaded.optimizer  # with its state (slots, iterations, learning rate)
    else:
        input_shape = task.spatial_shape(args) + (channels,)
        base = build_unet(input_shape, classes=1, depth=args.depth, base_filters=args.base_filters,
                          batch_norm=args.batch_norm, dropout=args.dropout, bn_momentum=args.bn_momentum,
                          name=task.name.replace("segmentation", "unet"))
        optimizer = keras.optimizers.Adam(args.lr * rt.size)
    model = keras_lms.wrap(base, **wrap_kwargs(args)) if args.lms else base
    if rt.hvd is not None and not rt.hvd.is_distributed(optimizer):
        optimizer = rt.hvd.DistributedOptimizer(optimizer)
    # No XLA: keras-lms needs explicit host placement and Horovod's ops are built without XLA.
    model.compile(optimizer=optimizer, loss=DiceBCELoss(), metrics=[Dice(), IoU()], jit_compile=False)
    return model, base
