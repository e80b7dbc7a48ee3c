"""Run state of the segmentation examples: the files in ``--out`` that make a run resumable.

``checkpoint.keras`` (model and optimizer, written by :class:`~examples.callbacks.AtomicCheckpoint`) and
``checkpoint.json`` (completed epochs, epoch logs and flags, written by :class:`~examples.callbacks.RunState`);
:func:`read_state` checks both before ``--resume`` continues from them. JSON files are written atomically.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: cli imports this module
    from .cli import Task

CHECKPOINT = "checkpoint.keras"
STATE = "checkpoint.json"
# Flags that change the model's architecture or input: a checkpoint only fits a run with the same values.
MODEL_FLAGS = ("size", "depth", "base_filters", "batch_norm", "bn_momentum", "dropout", "mixed_precision")


def jsonable(value):
    """``value`` for JSON: a float (None for NaN and infinities), or its ``str`` when it is not a number."""
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
