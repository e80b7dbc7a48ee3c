"""Files of a wrapped model: written atomically, and weights files in the 0.1 layout recognised.

Note: [atomic files]. A file that a crash, a kill or a full disk interrupts must not replace a good one. So a file
is written under a temporary name in its own directory, flushed to the disk (`fsync`), moved over the old name
with `os.replace` (atomic on POSIX within one file system), and the directory is flushed too, so the new name
survives a power loss. An interrupted write leaves the previous file and, after a SIGKILL, a hidden `.tmp`
file next to it that nothing reads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from keras_lms import _keras_adapter as adapter


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


class WrappedModelFiles:
    """The file methods of `LMSModel` (a mixin before `keras.Model`): `save`, `save_weights`, `load_weights`.

    Checked before a file is opened, written atomically (Note: [atomic files]), and weights files in the layout
    of the plain model (Note: [interchangeable weights files]).
    """

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`, checked before any file is opened and written atomically.

        Settings that cannot be saved (a predicate in include/exclude) and the legacy `.h5` format (which
        cannot store a wrapped model) are refused before anything is written. A local `.keras` file is
        written to a temporary file next to it and moved into place with `os.replace`, so an interrupted
        save (a crash, a kill, a full disk) leaves the previous file intact.
        """
        path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
        if path is not None and path.endswith((".h5", ".hdf5")):
            raise ValueError(
                f"Cannot save the wrapped model {self.name!r} in the legacy HDF5 format ({path!r}): it cannot store "
                "a keras-lms wrapper. Save it as '.keras' (wrapped.save('model.keras')), or save the plain model "
                "to .h5 with keras_lms.unwrap(wrapped).save(...), or only the weights with save_weights(...)."
            )
        self.get_config()  # raises the clear error for unsavable settings before a file is touched
        local = path is not None and path.endswith(".keras") and "://" not in path and zipped is not False
        if not local or (not overwrite and os.path.exists(path)):
            return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        save = super().save
        write_atomically(path, lambda tmp: save(tmp, overwrite=True, zipped=zipped, **kwargs))

    # Note: [interchangeable weights files]. Weights files of a wrapped model use the layout of the plain
    # model (its layers at the top, the optimizer next to them), so a `save_weights` file or a
    # `ModelCheckpoint(save_weights_only=True)` of either loads into the other. Files written by keras-lms
    # 0.1 (everything under `inner_model/`) still load into a wrapped model.
    @contextlib.contextmanager
    def _inner_with_our_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            optimizer = getattr(self.inner_model, "optimizer", None)
        with adapter.patched_attribute(self.inner_model, "optimizer", optimizer):
            yield self.inner_model

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save_weights` in the layout of the plain model (interchangeable with it), written atomically.

        A local `.weights.h5` file is written to a temporary file next to it, flushed and moved into place with
        `os.replace`, so an interrupted save (a crash, a kill, a full disk) leaves the previous file intact (Keras
        writes in place, and a kill mid-write leaves a file h5py cannot open). Sharded (`max_shard_size`) and
        remote files are written by Keras as before.
        """
        path = atomic_weights_path(filepath, kwargs)
        with self._inner_with_our_optimizer() as inner:
            if path is None or (not overwrite and os.path.exists(path)):  # Keras asks before overwriting
                return inner.save_weights(filepath, overwrite=overwrite, **kwargs)
            write_atomically(path, lambda tmp: inner.save_weights(tmp, overwrite=True, **kwargs),
                                    suffix=".tmp.weights.h5")

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Load weights saved by this wrapper, by another wrapper of the same model, or by the plain model."""
        if saved_by_wrapper_0_1(filepath):
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        with self._inner_with_our_optimizer() as inner:
            return inner.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
