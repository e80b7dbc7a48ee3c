"""Counters of what the torch back end moved: one ``TransferCounter`` per wrapped model (its ``Offloader``), and
the process-wide total ``transfer_stats()`` / ``reset_transfer_stats()`` that every model's counter adds to."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class TransferStats:
    """Cumulative counters of what the torch back end moved (since the last reset)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0
    shared_swap_ins: int = 0  # swap-ins served by a copy already on the device (no transfer)
    offloaded_calls: int = 0
    output_gradient_calls: int = 0
    lean_convolution_calls: int = 0  # convolution backward passes without recompute (lean_conv)
    lean_normalization_calls: int = 0  # BatchNormalization backward passes taken by the fused kernel (lean_norm)
    recomputed_outputs: int = 0  # tensors recomputed in a backward instead of brought back (recompute)
    plain_calls: int = 0


class TransferCounter:
    """A thread-safe ``TransferStats`` (backward passes run on autograd threads); ``count`` also adds to
    ``parent`` (a model's counter adds to the process-wide total)."""

    def __init__(self, parent: TransferCounter | None = None):
        self.parent = parent
        self._stats = TransferStats()
        self._lock = threading.Lock()

    def count(self, **deltas) -> None:
        """Add ``deltas`` to the counters."""
        with self._lock:
            for key, value in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + value)
        if self.parent is not None:
            self.parent.count(**deltas)

    def as_dict(self) -> dict:
        with self._lock:
            return dataclasses.asdict(self._stats)

    def reset(self) -> None:
        with self._lock:
            self._stats = TransferStats()


# Every model's counter adds here: what this process moved, all wrapped models together.
_TOTAL = TransferCounter()


def transfer_stats() -> dict:
    """What every wrapped model of this process moved since the last :func:`reset_transfer_stats` (one model's
    own counters: ``offloader_of(model).transfer_stats()``)."""
    return _TOTAL.as_dict()


def reset_transfer_stats() -> None:
    """Restart the process-wide total (each model's own counters are not touched)."""
    _TOTAL.reset()


def count(**deltas) -> None:
    """Add ``deltas`` to the process-wide total only (what a ``Transfer`` made without a model's counter moves)."""
    _TOTAL.count(**deltas)
