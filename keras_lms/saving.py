"""Files of a wrapped model: a `.keras` file written atomically, and weights files in the 0.1 layout recognised."""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, save) -> None:
    """Run `save(tmp)` on a temporary `.keras` file next to `path`, then move it into place with `os.replace`.

    An interrupted save (a crash, a kill, a full disk) leaves the previous file at `path` intact.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp.keras", dir=directory)
    os.close(fd)
    try:
        save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def saved_by_wrapper_0_1(filepath) -> bool:
    """A `.weights.h5` file in the 0.1 layout of wrapped models (everything under `inner_model/`)."""
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else ""
    if not path.endswith(".weights.h5") or not os.path.exists(path):
        return False
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return "inner_model" in f and "layers" not in f
    except OSError:
        return False
