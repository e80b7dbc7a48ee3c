"""What one `BackupAndRestore` backup holds, and how it is written and read back into a model.

Why a module of its own: the callback (keras_lms/backup.py) decides when to back up and which backup to resume
from; this module knows the files. A backup holds the weights and optimizer variables (`model.save_weights`, the
plain model's layout for a wrapped model) and `state.npz`: the random-seed generators' states and the running
metrics of the interrupted epoch, so that a resumed run draws the same Dropout masks and logs the same metrics.
The store (keras_lms/backup_store.py) makes the write atomic and checks every file before it is read.
"""

from __future__ import annotations

import json
import os
import warnings

import keras
import numpy as np

from keras_lms import random_state
from keras_lms.backup_store import Backup, BackupError

WEIGHTS = "model.weights.h5"
STATE = "state.npz"
# What keras.callbacks.BackupAndRestore writes; read once, when a run switches from Keras' callback to this one.
KERAS_FILES = ("latest.weights.h5", "training_metadata.json")


# ------------------------------------------------------------------ writing
def describe(model) -> dict:
    """What the manifest records about the writer, to name it when a backup does not fit."""
    return {"keras": keras.__version__, "backend": keras.backend.backend(),
            "seed_variables": [v.path for v in random_state.seed_state_variables(model)]}


def write(model, directory: str) -> None:
    """Write `model`'s backup files into `directory` (the store's hidden directory, renamed into place after)."""
    model.save_weights(os.path.join(directory, WEIGHTS), overwrite=True)
    arrays = random_state.capture(model)
    arrays.update({f"metric_{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.metrics_variables)})
    with open(os.path.join(directory, STATE), "wb") as fh:
        np.savez(fh, **arrays)


# ------------------------------------------------------------------ reading
def load(model, backup: Backup) -> dict:
    """Restore `backup`'s weights, optimizer and random state into `model`; returns its state arrays (metrics
    included, for `assign_metrics` once the resumed run reaches the backup's batch)."""
    _build_optimizer(model)
    try:
        model.load_weights(backup.file(WEIGHTS))
    except Exception as err:  # a checked file that does not load: another model wrote it
        raise ValueError(
            f"BackupAndRestore: the backup {backup.path!r} does not fit model {model.name!r} "
            f"({_first_line(err)}). It was written for another model; use that model, or another backup_dir."
        ) from None
    with np.load(backup.file(STATE)) as state:
        arrays = {name: state[name] for name in state.files}
    random_state.restore_model(model, arrays, where=f"the backup {backup.path!r}")
    return arrays


def load_keras_backup(model, directory: str) -> Backup | None:
    """Restore the files of `keras.callbacks.BackupAndRestore` in `directory`, as Keras would; None: there are none.

    Keras' backup holds no random-seed state and no position inside the epoch, so the resumed run restarts the
    epoch and is not exact: a warning says so.
    """
    weights, metadata = (os.path.join(directory, name) for name in KERAS_FILES)
    present = [os.path.basename(p) for p in (weights, metadata) if os.path.exists(p)]
    if not present:
        return None
    if len(present) == 1:
        raise BackupError(
            f"BackupAndRestore: {directory!r} holds {present[0]} of keras.callbacks.BackupAndRestore without "
            f"{({*KERAS_FILES} - {*present}).pop()}, so its position cannot be trusted. Restore the directory "
            "from a copy, or delete it to train from the start."
        )
    try:
        with open(metadata) as fh:
            epoch = int(json.load(fh)["epoch"])
        _build_optimizer(model)
        model.load_weights(weights)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BackupError(
            f"BackupAndRestore: the keras.callbacks.BackupAndRestore backup in {directory!r} cannot be restored "
            f"({_first_line(err)}). Restore the directory from a copy, or delete it to train from the start."
        ) from None
    warnings.warn(
        f"BackupAndRestore: resuming from the backup of keras.callbacks.BackupAndRestore in {directory!r} at the "
        "start of its epoch, as Keras would; it holds no random-seed state, so this resume is not exact.",
        stacklevel=3,
    )
    return Backup(directory, epoch, 0)


def metrics(arrays: dict) -> list:
    """The metric variables' values in the state arrays `load` returned, in `model.metrics_variables` order."""
    return [arrays[f"metric_{i}"] for i in range(sum(name.startswith("metric_") for name in arrays))]


def assign_metrics(model, values: list) -> None:
    """Put the interrupted epoch's running metrics back (with a warning, and nothing else, if they differ)."""
    variables = model.metrics_variables
    if [tuple(v.shape) for v in variables] != [np.shape(a) for a in values]:
        warnings.warn("BackupAndRestore: the model's metrics differ from the backup's; the interrupted epoch's "
                      "logged metrics restart from zero (the weights are not affected).", stacklevel=3)
        return
    for variable, value in zip(variables, values):
        variable.assign(value)


def _build_optimizer(model) -> None:
    """Create the optimizer's variables (Keras 3 does so at the first step) so that `load_weights` fills them."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
