"""Counters of what the torch back end moved: ``transfer_stats()`` and ``reset_transfer_stats()``."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class TransferStats:
    """Cumulative counters of what the torch back end moved (since the last :func:`reset_transfer_stats`)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0
    shared_swap_ins: int = 0  # swap-ins served by a copy already on the device (no transfer)
    offloaded_calls: int = 0
    output_gradient_calls: int = 0
    lean_convolution_calls: int = 0  # convolution backward passes without recompute (lean_conv)
    lean_normalization_calls: int = 0  # BatchNormalization backward passes taken by the fused kernel (lean_norm)
    plain_calls: int = 0


_STATS = TransferStats()
_STATS_LOCK = threading.Lock()


def transfer_stats() -> dict:
    with _STATS_LOCK:
        return dataclasses.asdict(_STATS)


def reset_transfer_stats() -> None:
    global _STATS
    with _STATS_LOCK:
        _STATS = TransferStats()


def count(**deltas):
    """Add ``deltas`` to the counters (thread-safe: backward passes run on autograd threads)."""
    with _STATS_LOCK:
        for key, value in deltas.items():
            setattr(_STATS, key, getattr(_STATS, key) + value)
