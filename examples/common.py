"""Shared code of the segmentation examples (``segmentation_3d.py`` and ``segmentation_2d.py``).

One module holds everything the two scripts have in common: command-line flags, Horovod set-up, the model
(``examples/unet.py``) with optional keras-lms wrapping, loss and metrics, callbacks (progress, memory
high-water marks, CSV log, checkpoints with ``--resume``), the training loop and the artefacts written to
``--out`` (plots, activation report, ``summary.json``). A script only says what its data look like
(:class:`Task`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
from keras import ops

import keras_lms

if __package__:  # imported as examples.common (python -m examples.segmentation_3d, the tests)
    from . import data as data_lib
    from .unet import build_unet
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    import data as data_lib
    from unet import build_unet

PACKAGE = "keras_lms_examples"
CHECKPOINT = "checkpoint.keras"
STATE = "checkpoint.json"
SUMMARY_KEYS = ("final_dice", "final_iou", "final_loss", "samples_per_s", "peak_device_mib", "peak_host_rss_mib",
                "offloaded_mib_per_step")


# --------------------------------------------------------------------------------------------- the task
@dataclasses.dataclass(frozen=True)
class Task:
    """What differs between the examples.

    Attributes:
        name: script name, used for the default ``--out`` and the model name.
        kind: "3d" or "2d" (selects the data classes in :mod:`examples.data`).
        size_flag: the flag giving the spatial edge (``--volume`` / ``--image-size``).
        default_size, default_depth: defaults of that flag and of ``--depth``.
        what: one line for ``--help``.
    """

    name: str
    kind: str
    size_flag: str
    default_size: int
    default_depth: int
    what: str

    @property
    def ndim(self) -> int:
        return 3 if self.kind == "3d" else 2

    def spatial_shape(self, args) -> tuple:
        return (args.size,) * self.ndim


# ------------------------------------------------------------------------------------------------ flags
def build_parser(task: Task) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{task.name}.py", description=task.what,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument(task.size_flag, dest="size", type=int, default=task.default_size, metavar="N",
                   help="edge of the (cubic / square) training crop in voxels/pixels; divisible by 2**depth")
    g.add_argument("--data-dir", default=None,
                   help="real data: a directory of NAME_image/NAME_label pairs (NIfTI for 3D, PNG/TIFF for 2D); "
                        "default: the embedded synthetic generator")
    g.add_argument("--val-fraction", type=float, default=0.2, help="share of --data-dir files kept for validation")
    g.add_argument("--loader", choices=("tfdata", "pydataset"), default="tfdata",
                   help="tfdata: tf.data over the PyDataset (static batch shapes, so keras-lms plans for the real "
                        "batch size); pydataset: hand the PyDataset to Keras (its own workers/queue)")
    g.add_argument("--workers", type=int, default=2, help="parallel batch loaders (tf.data calls / PyDataset workers)")
    g.add_argument("--use-multiprocessing", action="store_true",
                   help="PyDataset workers are processes (--loader pydataset)")
    g.add_argument("--max-queue-size", type=int, default=4, help="batches prefetched per rank")
    g = p.add_argument_group("model")
    g.add_argument("--depth", type=int, default=task.default_depth, help="U-Net levels")
    g.add_argument("--base-filters", type=int, default=16, help="filters of the first level (doubled per level)")
    g.add_argument("--batch-norm", action=argparse.BooleanOptionalAction, default=True, help="BatchNorm in blocks")
    g.add_argument("--bn-momentum", type=float, default=0.9,
                   help="BatchNorm momentum of the moving statistics used for validation/inference")
    g.add_argument("--dropout", type=float, default=0.1, help="Dropout rate at the bottleneck (0: none)")
    g.add_argument("--mixed-precision", action="store_true",
                   help="mixed_float16, for GPUs with tensor cores (3D on CPU fails: TensorFlow has no float16 "
                        "MaxPool3D CPU kernel)")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=2, help="samples per step per rank")
    g.add_argument("--epochs", type=int, default=5, help="total epochs (a resumed run continues up to this)")
    g.add_argument("--steps-per-epoch", type=int, default=None,
                   help="batches per epoch per rank (synthetic default 20; real data: files per rank / batch)")
    g.add_argument("--val-steps", type=int, default=None,
                   help="validation batches per rank (synthetic default 2; real data: val files per rank / batch)")
    g.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate for one rank (scaled by ranks)")
    g.add_argument("--warmup-epochs", type=int, default=2, help="learning-rate warm-up epochs with --horovod")
    g.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="after the warm-up: cosine decay over the remaining epochs, or constant")
    g.add_argument("--seed", type=int, default=0, help="seed of data, weights and dropout")
    g.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2),
                   help="Keras progress output on rank 0: 1 progress bar, 2 one line per epoch")
    g = p.add_argument_group("keras-lms")
    g.add_argument("--lms", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the model with keras_lms.wrap (activations offloaded to host memory)")
    g.add_argument("--min-bytes", default=None,
                   help="keras_lms.wrap(min_bytes=...): smaller tensors stay on the device, e.g. 1MiB")
    g.add_argument("--keep-last", type=int, default=None, help="keras_lms.wrap(keep_last=...)")
    g.add_argument("--prefetch", type=int, default=None, help="keras_lms.wrap(prefetch=...)")
    g.add_argument("--budget", default=None,
                   help="device budget, e.g. 6GiB: keras_lms.wrap(device_budget=...) offloads only what the step "
                        "needs to fit (implies --lms)")
    g = p.add_argument_group("runtime")
    g.add_argument("--horovod", action="store_true",
                   help="data-parallel with keras_lms.horovod (launch with horovodrun or mpirun)")
    g.add_argument("--out", default=f"runs/{task.name}", help="directory for checkpoints, logs and plots")
    g.add_argument("--resume", action="store_true",
                   help=f"continue from --out/{CHECKPOINT} at the epoch recorded in --out/{STATE}")
    g.add_argument("--dry-run", action="store_true",
                   help="do not train: save the (untrained) model as --out/model.keras for `keras-lms report`, "
                        "print its activation report and write activation_report.png")
    return p


def parse_args(task: Task, argv=None) -> argparse.Namespace:
    parser = build_parser(task)
    args = parser.parse_args(argv)
    for name in ("size", "batch_size", "epochs", "depth", "base_filters"):
        if getattr(args, name) < 1:
            flag = task.size_flag if name == "size" else f"--{name.replace('_', '-')}"
            parser.error(f"{flag} must be >= 1; got {getattr(args, name)}")
    for name in ("steps_per_epoch", "val_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.size % 2 ** args.depth:
        parser.error(f"{task.size_flag} {args.size} must be divisible by 2**depth = {2 ** args.depth} "
                     f"(try {task.size_flag} {max(1, round(args.size / 2 ** args.depth)) * 2 ** args.depth})")
    if not 0 <= args.dropout < 1:
        parser.error("--dropout must be in [0, 1)")
    if not 0 <= args.bn_momentum < 1:
        parser.error("--bn-momentum must be in [0, 1)")
    if args.budget is not None:
        args.lms = True
    problem = _unwritable_dir(pathlib.Path(args.out))
    if problem:
        parser.error(f"--out {args.out}: {problem}; choose a directory you can write to")
    return args


def _unwritable_dir(path: pathlib.Path) -> str | None:
    """Why ``path`` cannot be used as (or created as) an output directory, or None when it can."""
    if path.exists() and not path.is_dir():
        return "exists and is not a directory"
    probe = path
    while not probe.exists():  # the nearest existing ancestor decides whether it can be created
        if probe.parent == probe:
            return "no existing parent directory"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


# -------------------------------------------------------------------------------------- loss and metrics
def _spatial_axes(x) -> list[int]:
    return list(range(1, len(x.shape)))


@keras.saving.register_keras_serializable(package=PACKAGE)
class DiceBCELoss(keras.losses.Loss):
    """Binary cross-entropy plus soft Dice loss (``1 - soft Dice`` per sample), the usual pair for small lesions.

    Cross-entropy gives well-behaved gradients from the first step; the Dice term counters the foreground /
    background imbalance (lesions are 1-10 % of the voxels).
    """

    def __init__(self, smooth: float = 1.0, bce_weight: float = 1.0, dice_weight: float = 1.0, name="dice_bce",
                 reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.smooth, self.bce_weight, self.dice_weight = float(smooth), float(bce_weight), float(dice_weight)

    def call(self, y_true, y_pred):
        y_true = ops.cast(y_true, "float32")
        y_pred = ops.cast(y_pred, "float32")
        axes = _spatial_axes(y_pred)
        bce = ops.mean(keras.losses.binary_crossentropy(y_true, y_pred), axis=axes[:-1])
        intersection = ops.sum(y_true * y_pred, axis=axes)
        total = ops.sum(y_true, axis=axes) + ops.sum(y_pred, axis=axes)
        soft_dice = (2.0 * intersection + self.smooth) / (total + self.smooth)
        return self.bce_weight * bce + self.dice_weight * (1.0 - soft_dice)

    def get_config(self):
        return {**super().get_config(), "smooth": self.smooth, "bce_weight": self.bce_weight,
                "dice_weight": self.dice_weight}


class _OverlapMetric(keras.metrics.Metric):
    """Accumulates |P & T|, |P| and |T| of thresholded masks over all batches since the last reset (the epoch).

    The counts are kept in float64 so that an epoch of large volumes (> 2**24 voxels) still counts exactly.
    """

    def __init__(self, threshold: float = 0.5, name=None, dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.threshold = float(threshold)
        self.intersection = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="intersection")
        self.predicted = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="predicted")
        self.actual = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="actual")

    def update_state(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise ValueError(f"{type(self).__name__} does not support sample_weight.")
        t = ops.cast(ops.cast(y_true, "float32") > self.threshold, "float32")
        p = ops.cast(ops.cast(y_pred, "float32") > self.threshold, "float32")
        self.intersection.assign_add(ops.cast(ops.sum(t * p), "float64"))
        self.predicted.assign_add(ops.cast(ops.sum(p), "float64"))
        self.actual.assign_add(ops.cast(ops.sum(t), "float64"))

    def reset_state(self):
        for v in (self.intersection, self.predicted, self.actual):
            v.assign(ops.zeros((), "float64"))

    def _ratio(self, numerator, denominator):
        # Both masks empty: perfect agreement (1.0), not 0/0.
        value = ops.where(denominator > 0, numerator / ops.maximum(denominator, 1.0), ops.ones((), "float64"))
        return ops.cast(value, "float32")

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}


@keras.saving.register_keras_serializable(package=PACKAGE)
class Dice(_OverlapMetric):
    """Dice coefficient 2|P & T| / (|P| + |T|) of masks thresholded at ``threshold``, over the whole epoch."""

    def __init__(self, threshold: float = 0.5, name="dice", dtype=None):
        super().__init__(threshold, name=name, dtype=dtype)

    def result(self):
        return self._ratio(2.0 * self.intersection, self.predicted + self.actual)


@keras.saving.register_keras_serializable(package=PACKAGE)
class IoU(_OverlapMetric):
    """Intersection over union |P & T| / |P | T| of masks thresholded at ``threshold``, over the whole epoch."""

    def __init__(self, threshold: float = 0.5, name="iou", dtype=None):
        super().__init__(threshold, name=name, dtype=dtype)

    def result(self):
        return self._ratio(self.intersection, self.predicted + self.actual - self.intersection)


# ------------------------------------------------------------------------------------------- runtime
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


def _broadcast_int(rt: Runtime, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if rt.size == 1:
        return int(value)
    var = keras.Variable(np.array([value], "int64"), trainable=False, name="broadcast_int")
    rt.hvd.broadcast_variables([var], root_rank=0)
    return int(keras.ops.convert_to_numpy(var)[0])


# --------------------------------------------------------------------------------------------- model
def wrap_kwargs(args) -> dict:
    kwargs = {}
    for flag, key in (("min_bytes", "min_bytes"), ("keep_last", "keep_last"), ("prefetch", "prefetch"),
                      ("budget", "device_budget")):
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


# ----------------------------------------------------------------------------------------- callbacks
class Throughput(keras.callbacks.Callback):
    """Logs ``samples_per_s`` (all ranks together) per epoch, from the end of the first batch to the last one.

    Batch 0 is left out because it includes tracing the training step (seconds); with a single step per epoch
    the whole step is timed.
    """

    def __init__(self, global_batch: int):
        super().__init__()
        self.global_batch = int(global_batch)
        self._t0 = self._t_first = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._t0, self._t_first, self._batches = time.perf_counter(), None, 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self._t_last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._batches:
            return
        if self._batches > 1:
            seconds, batches = self._t_last - self._t_first, self._batches - 1
        else:
            seconds, batches = self._t_last - self._t0, 1
        logs["samples_per_s"] = batches * self.global_batch / max(seconds, 1e-9)


class DataEpoch(keras.callbacks.Callback):
    """Tells the training data which epoch starts (fresh synthetic samples / random crops per epoch, and the
    same ones again when a run is resumed at that epoch)."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def on_epoch_begin(self, epoch, logs=None):
        self.dataset.set_epoch(epoch)


class AtomicCheckpoint(keras.callbacks.Callback):
    """Saves the model after every epoch to a temporary file next to ``path`` and moves it into place.

    ``os.replace`` is atomic on POSIX file systems: a kill or crash during the save leaves the previous epoch's
    checkpoint intact (keras.callbacks.ModelCheckpoint writes the target file in place). Put it only in rank 0's
    callback list.
    """

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = pathlib.Path(path)

    def on_epoch_end(self, epoch, logs=None):
        tmp = self.path.with_name(f".{self.path.stem}.tmp{self.path.suffix}")
        try:
            self.model.save(tmp)
            os.replace(tmp, self.path)
        finally:
            if tmp.exists():
                tmp.unlink()


class RunState(keras.callbacks.Callback):
    """Writes ``checkpoint.json`` after each epoch: completed epochs (for ``--resume``) and all epoch logs.

    Put it after AtomicCheckpoint: the JSON then never names an epoch whose checkpoint is not on disk.
    """

    def __init__(self, path: pathlib.Path, history: list, meta: dict):
        super().__init__()
        self.path, self.history, self.meta = pathlib.Path(path), history, meta

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1}
        row.update({k: _jsonable(v) for k, v in (logs or {}).items()})
        self.history.append(row)
        write_json(self.path, {"epoch": epoch + 1, "checkpoint": CHECKPOINT, "history": self.history, **self.meta})


def cosine_schedule(peak_lr: float, warmup_epochs: int, epochs: int):
    """``schedule(epoch, lr)`` for LearningRateScheduler: untouched during warm-up (the warm-up callback sets the
    rate per batch there), then ``peak_lr * (1 + cos(pi * t)) / 2`` with ``t`` going from 0 to almost 1."""

    def schedule(epoch, lr):
        if epoch < warmup_epochs:
            return lr
        span = max(1, epochs - warmup_epochs)
        return float(peak_lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / span)))

    return schedule


def make_callbacks(args, rt: Runtime, out: pathlib.Path, history: list, resumed: bool, meta: dict,
                   train_ds) -> list:
    """The callback list, in the order that matters.

    The data epoch first, Horovod callbacks next (weights broadcast; averaged epoch logs before anyone reads
    them), then the learning-rate schedule, the memory high-water marks (every rank: it gathers min/max over
    ranks) and throughput, then the rank-0-only writers: CSV log, checkpoint, resume state. Keras adds its
    progress bar last, so it shows averaged values.
    """
    callbacks = [DataEpoch(train_ds)]
    warmup = 0
    if rt.hvd is not None:
        callbacks += [rt.hvd.BroadcastGlobalVariablesCallback(0), rt.hvd.MetricAverageCallback()]
        if args.warmup_epochs > 0:
            warmup = args.warmup_epochs
            callbacks.append(rt.hvd.LearningRateWarmupCallback(initial_lr=args.lr * rt.size, warmup_epochs=warmup))
    if args.lr_schedule == "cosine":
        callbacks.append(keras.callbacks.LearningRateScheduler(cosine_schedule(args.lr * rt.size, warmup, args.epochs)))
    # across_ranks: every rank runs this callback, so it may allgather (the summary reports the max over ranks).
    callbacks += [keras_lms.MemoryHighWaterMark(across_ranks=rt.hvd is not None), Throughput(args.batch_size * rt.size)]
    if rt.is_root:
        callbacks += [
            keras.callbacks.CSVLogger(str(out / "training_log.csv"), append=resumed),
            AtomicCheckpoint(out / CHECKPOINT),
            RunState(out / STATE, history, meta),
        ]
    return callbacks


# -------------------------------------------------------------------------------------------- helpers
def _jsonable(value):
    try:
        value = float(np.asarray(value))
    except (TypeError, ValueError):
        return str(value)
    return None if math.isnan(value) or math.isinf(value) else value


def write_json(path: pathlib.Path, obj) -> None:
    """Write atomically (a crash mid-write leaves the previous file)."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


# Flags that change the model's architecture or input: a checkpoint only fits a run with the same values.
MODEL_FLAGS = ("size", "depth", "base_filters", "batch_norm", "bn_momentum", "dropout", "mixed_precision")


class ResumeError(SystemExit):
    """``--resume`` cannot continue from --out (exits with the message)."""


def read_state(out: pathlib.Path, args=None, task: Task | None = None) -> dict | None:
    """The run state of a resumable run in ``out``, or None when there is none.

    Raises :class:`ResumeError` when the checkpoint is damaged (e.g. a run killed mid-save by an older
    version) or was written with other model flags than ``args``.
    """
    path = out / STATE
    checkpoint = out / CHECKPOINT
    if not path.exists() or not checkpoint.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ResumeError(f"--resume: {path} is damaged ({err}). Delete it (and {checkpoint}) to start over, or "
                          "restore both from a backup.") from err
    import zipfile

    if not zipfile.is_zipfile(checkpoint):
        raise ResumeError(f"--resume: {checkpoint} is damaged or incomplete (not a .keras zip archive; was the run "
                          f"killed while saving?). Delete {checkpoint} and {path} to start over.")
    if args is not None:
        saved = state.get("args", {})
        for name in MODEL_FLAGS:
            if name in saved and saved[name] != getattr(args, name):
                flag = task.size_flag if task is not None and name == "size" else f"--{name.replace('_', '-')}"
                raise ResumeError(
                    f"--resume: the checkpoint in {out} was trained with {flag} {saved[name]!r}, this run asks for "
                    f"{getattr(args, name)!r}. Use {flag} {saved[name]!r} to resume, or another --out to start a "
                    "new run.")
    return state


def _series(history: list, key: str) -> list:
    return [row.get(key) for row in history]


def _last(history: list, *keys):
    for key in keys:
        for row in reversed(history):
            if row.get(key) is not None:
                return row[key], key
    return None, None


def _max(history: list, *keys):
    for key in keys:
        values = [row[key] for row in history if row.get(key) is not None]
        if values:
            return max(values)
    return None


# ------------------------------------------------------------------------------------------ artefacts
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(history: list, path: pathlib.Path, title: str) -> pathlib.Path:
    """Three panels per epoch: loss, Dice/IoU (train and validation), memory high-water marks."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    epochs = [row["epoch"] for row in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("loss", [("loss", "train"), ("val_loss", "validation")], None),
        ("Dice / IoU (threshold 0.5)", [("dice", "Dice train"), ("val_dice", "Dice validation"),
                                        ("iou", "IoU train"), ("val_iou", "IoU validation")], (0, 1)),
        ("memory per rank (MiB)", [("peak_device_mib", "peak device"), ("peak_host_rss_mib", "peak host RSS"),
                                   ("offloaded_mib", "offloaded per step")], None),
    ]
    for ax, (label, series, ylim) in zip(axes, panels):
        for key, name in series:
            values = _series(history, key)
            if any(v is not None for v in values):
                ax.plot(epochs, [np.nan if v is None else v for v in values], marker="o", label=name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(label)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _display(image: np.ndarray) -> np.ndarray:
    """A standardised image (H, W, C) as something imshow shows well: grey or RGB in [0, 1]."""
    lo, hi = np.percentile(image, (1, 99))
    shown = np.clip((image - lo) / max(hi - lo, 1e-6), 0, 1)
    return shown[..., 0] if shown.shape[-1] != 3 else shown


def plot_sample(image, truth, prob, path: pathlib.Path, title: str) -> pathlib.Path:
    """Image / ground truth / prediction of one 2D slice (arrays (H, W, C), (H, W), (H, W))."""
    plt = _plt()
    step = max(1, int(math.ceil(max(truth.shape) / 1024)))  # 2048-pixel tiles: show at most ~1024 pixels
    image, truth, prob = image[::step, ::step], truth[::step, ::step], prob[::step, ::step]
    pred = prob > 0.5
    inter, total = float((pred & (truth > 0.5)).sum()), float(pred.sum() + (truth > 0.5).sum())
    dice = 2 * inter / total if total else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    shown = _display(image)
    axes[0].imshow(shown, cmap=None if shown.ndim == 3 else "gray")
    axes[0].set_title("image")
    axes[1].imshow(truth, cmap="viridis", vmin=0, vmax=1)
    axes[1].set_title("ground truth")
    axes[2].imshow(prob, cmap="viridis", vmin=0, vmax=1)
    if pred.any() and not pred.all():
        axes[2].contour(pred.astype(float), levels=[0.5], colors="red", linewidths=0.8)
    axes[2].set_title(f"prediction (red: > 0.5), slice Dice {dice:.3f}")
    for ax in axes:
        ax.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sample_prediction(model, dataset, task: Task, path: pathlib.Path) -> pathlib.Path:
    """Predict the first validation batch; plot the sample (and, in 3D, the axial slice) with most lesion."""
    x, y = dataset[0]
    prob = np.asarray(model.predict(x, batch_size=len(x), verbose=0), dtype=np.float32)
    i = int(np.argmax(y.reshape(len(y), -1).sum(axis=1)))
    image, truth, p = x[i], y[i, ..., 0], prob[i, ..., 0]
    where = ""
    if task.ndim == 3:
        z = int(np.argmax(truth.reshape(truth.shape[0], -1).sum(axis=1)))
        image, truth, p = image[z], truth[z], p[z]
        where = f", slice {z}"
    return plot_sample(image, truth, p, path, f"{task.name}: validation sample {i}{where}")


# ------------------------------------------------------------------------------------------ main loop
def run(task: Task, argv=None) -> dict | None:
    """Parse flags, train, write artefacts; returns the summary on rank 0 (None elsewhere)."""
    args = parse_args(task, argv)
    rt = setup_runtime(args)
    out = pathlib.Path(args.out)
    if rt.is_root:
        out.mkdir(parents=True, exist_ok=True)

    train_ds, val_ds, channels = data_lib.make_datasets(
        task.kind, task.spatial_shape(args), data_dir=args.data_dir, batch_size=args.batch_size,
        steps=args.steps_per_epoch, val_steps=args.val_steps, seed=args.seed, rank=rt.rank, size=rt.size,
        val_fraction=args.val_fraction, workers=args.workers, use_multiprocessing=args.use_multiprocessing,
        max_queue_size=args.max_queue_size)

    if args.dry_run:
        return dry_run(args, task, channels, rt, out) if rt.is_root else None

    state = read_state(out, args, task) if args.resume else None
    if args.resume and state is None:
        rt.log(f"--resume: no {CHECKPOINT} + {STATE} in {out}; starting from scratch.")
    initial_epoch = _broadcast_int(rt, state["epoch"] if state else 0)
    # Every rank that can read the checkpoint loads it; a rank that cannot (no shared file system) starts from
    # fresh weights, which BroadcastGlobalVariablesCallback replaces by rank 0's before the first update.
    restore = out / CHECKPOINT if initial_epoch and (out / CHECKPOINT).exists() else None
    model, base = build_model(args, task, channels, rt, restore)
    if args.loader == "tfdata":
        train_data = data_lib.to_tf_dataset(train_ds, args.workers, args.max_queue_size)
        val_data = data_lib.to_tf_dataset(val_ds, args.workers, args.max_queue_size)
    else:
        train_data, val_data = train_ds, val_ds
    history = list(state.get("history", [])) if state else []
    if initial_epoch:
        rt.log(f"Resuming from {out / CHECKPOINT} after epoch {initial_epoch}.")

    global_batch = args.batch_size * rt.size
    rt.log(f"{task.name}: input {task.spatial_shape(args) + (channels,)}, {rt.size} rank(s) x batch "
           f"{args.batch_size} = global batch {global_batch}, {train_ds.steps} steps/epoch, "
           f"{'LMS ' + str(wrap_kwargs(args) or 'defaults') if args.lms else 'no LMS'}, "
           f"data: {args.data_dir or 'synthetic'}, out: {out}")
    meta = {"example": task.name, "args": vars(args)}
    callbacks = make_callbacks(args, rt, out, history, resumed=bool(initial_epoch), meta=meta, train_ds=train_ds)
    verbose = args.verbose if rt.is_root else 0

    t0 = time.perf_counter()
    fit_history = {}
    if initial_epoch < args.epochs:
        fit_history = model.fit(train_data, validation_data=val_data, epochs=args.epochs, initial_epoch=initial_epoch,
                                callbacks=callbacks, verbose=verbose).history
    else:
        rt.log(f"Already trained for {initial_epoch} >= --epochs {args.epochs} epochs; nothing to train.")
    train_seconds = time.perf_counter() - t0
    if not rt.is_root:
        return None
    return write_artefacts(args, task, model, base, val_ds, history, fit_history, train_seconds, rt, out,
                           initial_epoch, channels)


def dry_run(args, task: Task, channels: int, rt: Runtime, out: pathlib.Path) -> dict:
    """Build and save the model for these flags, print what keras-lms predicts for one training step."""
    model, _ = build_model(args, task, channels, Runtime(), None)  # a single-rank optimizer is enough here
    model.optimizer.build(model.trainable_variables)  # saved with its slots: loads without warnings
    model.save(out / "model.keras")
    rep = keras_lms.report(model, batch_size=args.batch_size)
    rep.plot(out / "activation_report.png")
    text = rep.to_text()
    (out / "activation_report.txt").write_text(text + "\n")
    print(text)
    print(f"model written to {out / 'model.keras'}; e.g. keras-lms report {out / 'model.keras'} "
          f"--batch-size {args.batch_size} --budget 6GiB --plot {out / 'report.png'}")
    return {k: _jsonable(v) for k, v in rep.totals.items()}


def write_artefacts(args, task, model, base, val_ds, history, fit_history, train_seconds, rt, out,
                    initial_epoch, channels) -> dict:
    """Plots, activation report, summary.json (rank 0)."""
    artefacts = {}
    if history:
        artefacts["training_curves"] = str(plot_curves(
            history, out / "training_curves.png",
            f"{task.name}: {rt.size} rank(s), batch {args.batch_size}/rank, {'LMS' if args.lms else 'no LMS'}"))
    rep = keras_lms.report(model, batch_size=args.batch_size)
    artefacts["activation_report"] = str(rep.plot(out / "activation_report.png"))
    (out / "activation_report.txt").write_text(rep.to_text() + "\n")
    report_totals = {k: _jsonable(v) for k, v in rep.totals.items()}
    artefacts["sample_prediction"] = str(sample_prediction(model, val_ds, task, out / "sample_prediction.png"))
    if (out / CHECKPOINT).exists():
        artefacts["checkpoint"] = str(out / CHECKPOINT)
    if (out / "training_log.csv").exists():
        artefacts["training_log"] = str(out / "training_log.csv")

    final_dice, dice_key = _last(history, "val_dice", "dice")
    final_iou, _ = _last(history, "val_iou", "iou")
    final_loss, _ = _last(history, "val_loss", "loss")
    rates = [v for v in fit_history.get("samples_per_s", []) if v is not None]
    steady = rates[1:] if len(rates) > 1 else rates
    offloaded = getattr(model, "offloaded_bytes_per_step", 0) or 0
    summary = {
        "example": task.name,
        "final_dice": final_dice,
        "dice_source": dice_key,
        "final_iou": final_iou,
        "final_loss": final_loss,
        "samples_per_s": statistics.median(steady) if steady else None,
        "train_seconds": round(train_seconds, 2),
        "peak_device_mib": _max(history, "peak_device_mib_max", "peak_device_mib"),
        "peak_host_rss_mib": _max(history, "peak_host_rss_mib_max", "peak_host_rss_mib"),
        "offloaded_mib_per_step": offloaded / 2**20,
        "epochs_completed": history[-1]["epoch"] if history else initial_epoch,
        "initial_epoch": initial_epoch,
        "ranks": rt.size,
        "batch_size_per_rank": args.batch_size,
        "global_batch_size": args.batch_size * rt.size,
        "input_shape": list(task.spatial_shape(args) + (channels,)),
        "lms": bool(args.lms),
        "lms_settings": wrap_kwargs(args) if args.lms else None,
        "data": args.data_dir or "synthetic",
        "activation_report": report_totals,
        "artefacts": artefacts,
    }
    write_json(out / "summary.json", summary)
    print_summary(summary, out)
    return summary


def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def print_summary(s: dict, out: pathlib.Path) -> None:
    dice_name = "validation Dice" if s["dice_source"] == "val_dice" else "training Dice"
    lines = [
        "",
        f"== {s['example']} summary ({s['ranks']} rank(s), global batch {s['global_batch_size']}, "
        f"{s['epochs_completed']} epoch(s), {'LMS' if s['lms'] else 'no LMS'}) ==",
        f"final {dice_name}:    {_fmt(s['final_dice'], '.3f')}   (IoU {_fmt(s['final_iou'], '.3f')}, "
        f"loss {_fmt(s['final_loss'], '.4f')})",
        f"throughput:             {_fmt(s['samples_per_s'], '.2f')} samples/s (all ranks, steady state); "
        f"training took {s['train_seconds']:.0f} s",
        f"peak device memory:     {_fmt(s['peak_device_mib'], '.0f')} MiB per rank",
        f"peak host memory (RSS): {_fmt(s['peak_host_rss_mib'], '.0f')} MiB per rank",
        f"offloaded per step:     {s['offloaded_mib_per_step']:.1f} MiB per rank",
    ]
    rep = s.get("activation_report")
    if rep:
        lines.append(f"activation report:      {rep['device_activation_bytes_plain'] / 2**20:.1f} MiB of saved "
                     f"activations without LMS, {rep['device_activation_bytes_wrapped'] / 2**20:.1f} MiB with")
    lines.append(f"artefacts in {out}/: " + ", ".join(pathlib.Path(p).name for p in s["artefacts"].values())
                 + ", summary.json")
    print("\n".join(lines), flush=True)
