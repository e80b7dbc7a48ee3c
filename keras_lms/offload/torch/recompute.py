"""Tensors recomputed instead of copied on torch (``recompute_candidates``): the step context's side.

When the plan recomputes a call's output ``T`` (``PlanEntry.recomputed_output``), the context registers a
``RecomputedCopy`` for ``T`` as its producer runs, and ``swap_out(T)`` hands that out instead of a host copy.
It stands in for a ``_HostCopy`` wherever a backward brings one back (``bring_back``, ``pending``,
``output_pending``, ``resident``, ``done``):

- its copy back brings the BatchNorm's input ``c`` back and leaves it on the device for the BatchNorm's own
  backward (``_HostCopy.shared_pending``), which would have brought it back two calls later anyway;
- when the reader's backward asks for ``T``, it is recomputed on the compute stream by the layers' own calls
  on ``c``: Keras' BatchNormalization with the forward's batch statistics and weight snapshot
  (``common.given_moments``), then the activation. Slab by slab along the first spatial axis into one output
  buffer, so the float32 temporaries of Keras' BatchNormalization (it computes in float32 under mixed
  precision) stay slab-sized. Every op is element-wise, so the values are the forward's, bit for bit, and
  nothing updates the moving statistics (the recompute is stateless).
"""

from __future__ import annotations

import keras
import torch

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.torch import step_memory

# The recompute's slabs: at most max(SLAB_ROWS, rows / SLABS) positions each (the lean normalisation's rule,
# which the planner charges as the recompute's temporaries: RecomputeSource.temporary_bytes).
SLABS = step_memory.LEAN_SLABS
SLAB_ROWS = step_memory.LEAN_SLAB_ROWS


def usable(norm, activation) -> bool:
    """Whether the records hold what the recompute needs (what planning assumed; else ``T`` is copied): the
    BatchNorm's input copied, its batch statistics kept, and the activation (if any) taking its gradient from
    its output."""
    if norm is None or norm.moments is None or len(norm.hosts) != 1 or norm.hosts[0] is None:
        return False
    return activation is None or (activation.output_grad is not None and not activation.trainable)


class RecomputedCopy:
    """Stands in for the host copy of ``T = activation(norm(c))`` (``activation`` may be None)."""

    __slots__ = ("norm", "activation", "source", "nbytes", "pending", "output_pending", "resident", "__weakref__")

    def __init__(self, norm, activation, nbytes: int):
        self.norm, self.activation, self.nbytes = norm, activation, nbytes
        self.source = norm.hosts[0]  # c's host copy: this recompute reads it, besides the BatchNorm's backward
        self.source.pending += 1
        self.pending = 0
        self.output_pending = 0
        self.resident = None

    def bring_back(self, transfer):
        """Start bringing ``c`` back (shared with the BatchNorm's backward); ``T`` is recomputed on ``get()``."""
        source = self.source
        swap = source.resident
        if swap is None:
            swap = transfer.to_device(source)
        else:
            self.norm.step.count(shared_swap_ins=1)
        source.resident = swap
        source.shared_pending += 1  # the BatchNorm's backward takes this copy
        source.done(output_reader=False)  # this recompute's read
        return RecomputedSwapIn(self.norm, self.activation, swap)

    def done(self, output_reader: bool, shared: bool = False) -> None:
        self.pending -= 1
        if output_reader:
            self.output_pending -= 1
        if self.output_pending <= 0:
            self.resident = None
        if self.pending <= 0:
            self.release()

    def release(self) -> None:
        self.resident = None
        self.norm = self.activation = None


class RecomputedSwapIn:
    """``T`` recomputed from ``c``'s swap-in when first asked for (the interface of ``_SwapIn``)."""

    __slots__ = ("norm", "activation", "source", "tensor")

    def __init__(self, norm, activation, source):
        self.norm, self.activation, self.source = norm, activation, source
        self.tensor = None

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            norm = self.norm
            self.tensor = recompute(norm, self.activation, self.source.get())
            norm.step.count(recomputed_outputs=1)
            self.norm = self.activation = self.source = None
        return self.tensor


def recompute(norm, activation, c: torch.Tensor) -> torch.Tensor:
    """``activation(norm(c))`` with the forward's statistics and snapshots, slab by slab (module docstring)."""
    bounds = _slab_bounds(norm, c)
    with torch.no_grad(), adapter.acyclic_torch_trees():
        if len(bounds) == 1:
            return _layers(norm, activation, c)
        out = None
        for a, b in bounds:
            piece = _layers(norm, activation, c[:, a:b])
            if out is None:
                out = piece.new_empty(tuple(c.shape[:1]) + (c.shape[1],) + tuple(piece.shape[2:]))
            out[:, a:b].copy_(piece)
        return out


def _layers(norm, activation, x):
    mean, variance = norm.moments
    args, kwargs = common.rebuild(norm.template, norm.positions, [x])
    with common.given_moments(norm.unit, lambda inputs: (mean, variance)):
        outputs, _, _ = adapter.run_stateless(norm.unit, norm.original, norm.trainable, norm.snapshot, args, kwargs,
                                              norm.autocast)
    y = keras.tree.flatten(outputs)[0]
    if activation is not None:
        args, kwargs = common.rebuild(activation.template, activation.positions, [y])
        outputs, _, _ = adapter.run_stateless(activation.unit, activation.original, [], activation.snapshot, args,
                                              kwargs, activation.autocast)
        y = keras.tree.flatten(outputs)[0]
    return y


def _slab_bounds(norm, c: torch.Tensor) -> list:
    """Row ranges along axis 1, each of at most max(SLAB_ROWS, positions / SLABS) positions; one range when the
    BatchNorm's channels are not the last axis (axis 1 could be them) or the tensor has no spatial axis."""
    axis = norm.unit.axis if isinstance(norm.unit.axis, int) else None
    if c.ndim < 3 or axis not in (-1, c.ndim - 1) or c.shape[1] < 2:
        return [(0, c.shape[1])]
    positions = c.numel() // max(c.shape[-1], 1)
    per_row = max(positions // c.shape[1], 1)  # positions in one row along axis 1
    step = max(1, max(SLAB_ROWS, -(-positions // SLABS)) // per_row)
    return [(a, min(a + step, c.shape[1])) for a in range(0, c.shape[1], step)]
