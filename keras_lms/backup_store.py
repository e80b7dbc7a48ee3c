"""The files of `keras_lms.BackupAndRestore`: backups that appear whole or not at all, and are checked when read.

Layout of one backup directory (one per Horovod rank when there are several):

    backup_dir/
        epoch-000003-step-000000010/   a complete backup: the training position is in its name
            model.weights.h5           (the files the callback writes)
            state.npz
            MANIFEST.json              written last: the position, and each file's size and SHA-256
        .incomplete-<name>-<pid>/      a backup being written; left behind by a kill, removed by the next save
        .stale-<name>-<pid>/           an old backup being deleted

Note: [one rename switches a backup in]. Keras' own callback rewrites `latest.weights.h5` and
`training_metadata.json` in place, one after the other: a kill inside the first leaves a file h5py cannot open, a
kill between them pairs new weights with an old epoch, and a missing weights file goes unnoticed. Here every file
of a backup is written into a fresh hidden directory, flushed to the disk, listed with its size and checksum in
`MANIFEST.json` (flushed too), and only then is the directory renamed to its final name and the parent flushed.
A rename within one file system is atomic, so a directory with a final name is always complete; the previous
backup is deleted only after the rename (renamed to `.stale-...` first, so a kill during the deletion leaves no
half-deleted directory under a final name). Reading checks every file against the manifest before h5py opens it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil

from keras_lms.saving import fsync_dir, fsync_file

FORMAT = "keras_lms.BackupAndRestore/1"
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^epoch-(\d+)-step-(\d+)$")


class BackupError(RuntimeError):
    """No backup in the directory can be restored; the message names the directory and what to do (one line)."""


@dataclasses.dataclass(frozen=True)
class Backup:
    """A complete backup directory: its path and the training position in its name (`epoch`, `steps` into it)."""

    path: str
    epoch: int
    steps: int

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def manifest(self) -> dict:
        """The parsed MANIFEST.json (call `BackupStore.problem` first: this does not check it)."""
        with open(self.file(MANIFEST)) as fh:
            return json.load(fh)


def backup_name(epoch: int, steps: int) -> str:
    """The directory name of the backup taken `steps` batches into epoch `epoch` (0-based); names sort by position."""
    return f"epoch-{epoch:06d}-step-{steps:09d}"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _switch(tmp: str, final: str) -> None:
    """The commit point of a backup: rename the complete temporary directory to its final name."""
    os.rename(tmp, final)


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class BackupStore:
    """The backups in one directory: write one atomically, list, check and prune them.

    Args:
        directory: the directory that holds the backups (created by the first `write`).
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.fspath(directory))

    # ------------------------------------------------------------------ reading
    def backups(self) -> list[Backup]:
        """The complete backups (those with a final name), newest first. Their files are not checked here."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            path = os.path.join(self.directory, name)
            if match and os.path.isdir(path):
                found.append(Backup(path, int(match.group(1)), int(match.group(2))))
        return sorted(found, key=lambda b: (b.epoch, b.steps), reverse=True)

    def problem(self, backup: Backup) -> str | None:
        """What is wrong with `backup` (a missing, truncated or altered file, an unreadable manifest), or None."""
        try:
            manifest = backup.manifest()
        except FileNotFoundError:
            return f"{MANIFEST} is missing"
        except (OSError, ValueError) as err:
            return f"{MANIFEST} is unreadable ({type(err).__name__})"
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
                manifest.get("files"), dict):
            return f"{MANIFEST} is not a {FORMAT} manifest"
        if (manifest.get("epoch"), manifest.get("steps")) != (backup.epoch, backup.steps):
            return f"{MANIFEST} names another position (epoch {manifest.get('epoch')}, step {manifest.get('steps')})"
        for name, expected in sorted(manifest["files"].items()):
            path = backup.file(name)
            if not os.path.isfile(path):
                return f"{name} is missing"
            size = os.path.getsize(path)
            if size != expected.get("bytes"):
                return f"{name} has {size} bytes, the manifest says {expected.get('bytes')}"
            if sha256(path) != expected.get("sha256"):
                return f"{name} does not match its SHA-256 in the manifest"
        return None

    # ------------------------------------------------------------------ writing
    def write(self, epoch: int, steps: int, write_files, meta: dict | None = None) -> Backup:
        """Write a backup for position (`epoch`, `steps`): `write_files(tmp_dir)` writes its files.

        The backup appears under its final name only once every file and the manifest are on the disk; see
        Note: [one rename switches a backup in]. An exception in `write_files` leaves the existing backups as they
        were and is raised. `meta` (JSON-serialisable) is stored in the manifest.
        """
        self._makedirs()
        name = backup_name(epoch, steps)
        tmp = os.path.join(self.directory, f".incomplete-{name}-{os.getpid()}")
        _remove_tree(tmp)
        os.mkdir(tmp)
        try:
            write_files(tmp)
            files = {}
            for entry in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, entry)
                fsync_file(path)
                files[entry] = {"bytes": os.path.getsize(path), "sha256": sha256(path)}
            manifest = {"format": FORMAT, "epoch": epoch, "steps": steps, "files": files, **(meta or {})}
            with open(os.path.join(tmp, MANIFEST), "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(tmp)
        except BaseException:
            _remove_tree(tmp)
            raise
        final = os.path.join(self.directory, name)
        if os.path.exists(final):  # a backup of the same position, from a run that was rolled back
            self._discard(final)
        _switch(tmp, final)
        fsync_dir(self.directory)
        return Backup(final, epoch, steps)

    def prune(self, current: Backup, keep: int) -> None:
        """Keep `current` (just written) and the `keep - 1` backups before it; delete the rest and the leftovers.

        Backups after `current` are deleted too: the run went back past them (they were not usable on resume).
        """
        self.discard_newer_than(current)
        for backup in self.backups()[keep:]:
            self._discard(backup.path)
        self.remove_leftovers()

    def discard_newer_than(self, backup: Backup | None) -> None:
        """Delete the backups newer than `backup` (all of them for None): a resume rolled the run back past them."""
        position = (-1, -1) if backup is None else (backup.epoch, backup.steps)
        for other in self.backups():
            if (other.epoch, other.steps) > position:
                self._discard(other.path)

    def remove_leftovers(self) -> None:
        """Remove `.incomplete-*` and `.stale-*` directories (left by a kill; nothing reads them)."""
        if not os.path.isdir(self.directory):
            return
        for entry in os.listdir(self.directory):
            if entry.startswith((".incomplete-", ".stale-")):
                _remove_tree(os.path.join(self.directory, entry))

    def remove_all(self) -> None:
        """Delete the whole directory (the callback's `delete_checkpoint=True` at the end of training)."""
        _remove_tree(self.directory)

    def _discard(self, path: str) -> None:
        stale = os.path.join(self.directory, f".stale-{os.path.basename(path)}-{os.getpid()}")
        _remove_tree(stale)
        os.rename(path, stale)  # no longer a complete backup from here on, even if the deletion is cut short
        fsync_dir(self.directory)
        _remove_tree(stale)

    def _makedirs(self) -> None:
        if os.path.isdir(self.directory):
            return
        os.makedirs(self.directory, exist_ok=True)
        fsync_dir(os.path.dirname(self.directory))
