"""How `BackupAndRestore` works under Horovod: find the job's ranks, and make them agree on one backup.

Why a module of its own: every rank writes its own backups, and a kill during a save can leave the ranks with
different newest backups; resuming each from its own would start them at different batches. This is the only
place that knows Horovod, which it never imports (a single-process run need not have it installed).
"""

from __future__ import annotations

import sys


def distributed_horovod():
    """Horovod's module when the program imported and initialised it with more than one rank, else None.

    Read from `sys.modules`: Horovod is never imported here (a single-process run need not have it installed).
    """
    for name in ("horovod.tensorflow", "horovod.torch"):
        hvd = sys.modules.get(name)
        try:
            if hvd is not None and hvd.is_initialized() and hvd.size() > 1:
                return hvd
        except (AttributeError, ValueError):
            continue
    return None


def agreed_backups(hvd, candidates: list, problems: list, has_backups: bool) -> tuple[list, bool]:
    """Of this rank's usable backups, those every rank has (newest first), and whether any rank has backups.

    An allgather: every rank calls it, and every rank gets the same answer. A kill during a save can leave some
    ranks with the new backup and others without it; resuming each rank from its own newest would start them at
    different batches. The previous backup is always kept under Horovod, so there is a common one.
    """
    gathered = hvd.allgather_object(([b.name for b in candidates], has_backups), name="keras_lms_backup_and_restore")
    common = set.intersection(*(set(names) for names, _ in gathered))
    behind = [b.name for b in candidates if b.name not in common]
    if behind:
        problems.append(f"{', '.join(behind)}: not written by every rank")
    anyone_has_backups = any(has for _, has in gathered)
    if not common and anyone_has_backups:
        problems.append("the ranks have no usable backup in common")
    return [b for b in candidates if b.name in common], anyone_has_backups
