"""Command line of the segmentation examples: what a script says about its data (:class:`Task`) and the flags.

:func:`parse_args` checks the values once, with errors that name the flag and the fix (``argparse`` exits with
them), before anything is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib

if __package__:  # imported as examples.cli (python -m examples.segmentation_3d, the tests)
    from .state import CHECKPOINT, STATE
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from state import CHECKPOINT, STATE


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
    g.add_argument("--slab-bytes", default=None,
                   help="keras_lms.wrap(slab_bytes=...): run full-resolution layers in slabs of this size, e.g. "
                        "128MiB (TensorFlow; 0 turns slabs off)")
    g.add_argument("--budget", default=None,
                   help="device budget, e.g. 6GiB: keras_lms.wrap(device_budget=...) offloads only what the step "
                        "needs to fit (implies --lms)")
    g = p.add_argument_group("runtime")
    g.add_argument("--horovod", action="store_true",
                   help="data-parallel with keras_lms.horovod (launch with horovodrun or mpirun)")
    g.add_argument("--elastic", action="store_true",
                   help="elastic Horovod (implies --horovod): launch with horovodrun --gloo --min-np/--max-np "
                        "--host-discovery-script; ranks may join, leave or die mid-run (docs/horovod.md)")
    g.add_argument("--commit-every", type=int, default=1, metavar="N",
                   help="with --elastic: commit the training state (in host memory) every N batches")
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
    if args.commit_every < 1:
        parser.error("--commit-every must be >= 1")
    if args.elastic:
        args.horovod = True
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
