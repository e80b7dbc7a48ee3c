"""Files of a wrapped model: written atomically, and weights files in the 0.1 layout recognised.

Note: [atomic files]. A file that a crash, a kill or a full disk interrupts must not replace a good one. So a file
is written under a temporary name in its own directory, flushed to the disk (`fsync`), moved over the old name
with `os.replace` (atomic on POSIX within one file system), and the directory is flushed too, so the new name
survives a power loss. An interrupted write leaves the previous file and, after a SIGKILL, a hidden `.tmp`
file next to it that nothing reads.
"""

from __future__ import annotations

import os
import tempfile


def fsync_file(path: str) -> None:
    """Flush `path`'s data to the disk (a file written by another library, e.g. h5py, once it is closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries, so that a rename or a new file in it survives a power loss (POSIX only)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - Windows cannot open a directory; its renames are journaled
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def write_atomically(path: str, save, suffix: str = ".tmp.keras") -> None:
    """Run `save(tmp)` on a temporary file next to `path`, flush it, then move it into place with `os.replace`.

    `suffix` ends the temporary name (Keras checks the extension: `.keras`, `.weights.h5`). An interrupted save
    (a crash, a kill, a full disk) leaves the previous file at `path` intact; see Note: [atomic files].
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        save(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_weights_path(filepath, kwargs: dict) -> str | None:
    """`filepath` as a str when `save_weights` can write it atomically (a local single `.weights.h5`), else None.

    Sharded weights (`max_shard_size`) are several files and remote paths (`gs://...`) have no atomic rename:
    those are written by Keras as before.
    """
    if not isinstance(filepath, (str, os.PathLike)) or kwargs.get("max_shard_size") is not None:
        return None
    path = os.fspath(filepath)
    return path if path.endswith(".weights.h5") and "://" not in path else None


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
