"""Recomputed tensors: a tensor that is never copied to host, its windows recomputed from its producer's inputs
wherever a backward (or a slab forward) would have read them from its host copy.

Why: on a PCIe GPU copying a tensor back costs far more than computing it again. A 16 -> 16 channel 3x3x3
convolution spends about 216 FLOPs per output byte in float32: 2.3 ms per GiB at 100 TFLOP/s, against 31 ms per
GiB back over a 35 GB/s link. Normalisation and activations cost microseconds per GiB. So the cheapest place to
keep most of a 3D U-Net's level-0 activations is nowhere: a few host copies (the input, a convolution's input)
and a chain of layer calls that recomputes the rest, window by window, when it is read.

A back end that computes calls in windows (TensorFlow's slabs) describes, per tensor it can recompute, how: a
``RecomputeSource`` (the producer's inputs, its halo along the sliced axis, its forward work per row). This
module is back-end free: ``expand_read`` turns a read of ``rows`` rows in ``windows`` windows of a tensor into
reads of the host copies at the leaves and the work of the chain in between, which the traffic and step-time
models add up. The producer's halo widens each window on the way down (a 3x3x3 convolution needs one more row
on each side); the chain stops at a tensor that has a host copy.

The planner (``choose_recomputed``) decides which tensors to recompute from the predicted step time on the
device profile; see its docstring for the search.
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecomputeSource:
    """How a tensor's windows are recomputed: call ``producer`` run on windows of its ``inputs``.

    Attributes:
        key: the tensor (its trace key).
        producer: index of the call that produces it.
        inputs: ``(key, bytes)`` of the producer's inputs (a concatenation's parts for a slab reader of one).
        length: rows of the tensor (and of its inputs) along the sliced axis.
        halo: extra rows the producer needs on each side of a window of its output.
        flops_per_row / bytes_per_row: the producer's forward kernel FLOPs and memory-bound bytes per output row.
        chosen: False for tensors the back end recomputes by itself (fused chains), whatever the planner says.
        exact_rows: the producer computes exactly the window's rows from its widened inputs (its FLOPs are those
            of the rows read), instead of convolving the widened window and cropping.
        scale: output rows per input row (an up-sampling producer, ``layer_facts.upsampling_scale``; its inputs
            have ``length // scale`` rows and a window reads ``1 / scale`` of its rows from them); 1 otherwise.
        resident: keys of inputs the plan keeps on the device: their windows are sliced there (no host bytes).
        shared_reader: a call whose own backward reads the producer's input whole from its host copy and takes
            the copy a recompute brought back instead of bringing it back again (torch: the BatchNormalization
            of a recomputed ``BatchNormalization -> activation`` output); None where windows are read.
        temporary_bytes: device bytes the recompute holds besides its result (its float32 slabs).
    """

    key: object
    producer: int
    inputs: tuple
    length: int
    halo: int
    flops_per_row: float
    bytes_per_row: float
    chosen: bool = True
    exact_rows: bool = False
    scale: int = 1
    resident: tuple = ()
    shared_reader: int | None = None
    temporary_bytes: int = 0


@dataclasses.dataclass
class ExpandedRead:
    """A read expanded to host copies: bytes per leaf key and the recompute work on the way."""

    leaves: dict = dataclasses.field(default_factory=dict)  # key -> (tensor bytes, bytes read)
    flops: float = 0.0
    elementwise_bytes: float = 0.0

    def add(self, other: "ExpandedRead") -> None:
        for key, (size, read) in other.leaves.items():
            total = self.leaves.get(key, (size, 0.0))[1]
            self.leaves[key] = (size, total + read)
        self.flops += other.flops
        self.elementwise_bytes += other.elementwise_bytes

    @property
    def bytes(self) -> float:
        return sum(read for _, read in self.leaves.values())


def expand_read(key, size: int, rows: float, windows: int, length: int, sources: dict) -> ExpandedRead:
    """A read of ``rows`` rows, in ``windows`` windows, of tensor ``key`` (``size`` bytes, ``length`` rows):
    itself when it has a host copy (``key`` not in ``sources``), else the reads of its producer's inputs over
    windows widened by the producer's halo, recursively, plus the producer's forward on those rows (on the rows
    read, for a producer that computes exactly them)."""
    out = ExpandedRead()
    source = sources.get(key)
    if source is None:
        out.leaves[key] = (size, size * rows / max(length, 1))
        return out
    widened = min(rows + 2 * source.halo * windows, source.length * windows)
    out.flops += source.flops_per_row * (rows if source.exact_rows else widened)
    out.elementwise_bytes += source.bytes_per_row * widened
    inner_length = source.length // source.scale
    # an up-sampler's window starts and ends inside an input row at worst: one more input row per window
    inner_rows = min(widened / source.scale + (windows if source.scale > 1 else 0), inner_length * windows)
    for input_key, input_size in source.inputs:
        if input_key not in source.resident:
            out.add(expand_read(input_key, input_size, inner_rows, windows, inner_length, sources))
    return out


def active_sources(sources: dict, recomputed) -> dict:
    """The recompute sources in effect: the back end's own (fused chains) and the chosen producers'."""
    return {key: s for key, s in sources.items() if not s.chosen or s.producer in recomputed}


def recomputed_producers(entries) -> frozenset:
    """The calls whose output the plan recomputes instead of copying (``PlanEntry.recomputed_output``)."""
    return frozenset(e.index for e in entries if getattr(e, "recomputed_output", False))


# How many producers up a chain the planner tries to recompute together: a BatchNormalization output that only
# an activation reads is never copied, so recomputing it alone saves nothing, while recomputing it with the
# activation after it removes the activation's output copy.
CHAIN_DEPTH = 3


def choose_recomputed(candidates: dict, step_seconds, fits=None, start=frozenset()) -> frozenset:
    """The producers whose outputs to recompute, chosen to shorten ``step_seconds(recomputed)``.

    The search: greedy in forward order. Each candidate is tried alone and together with its not yet chosen
    candidate ancestors (the producers of its inputs, and so on, up to ``CHAIN_DEPTH`` calls); the group that
    shortens the predicted step most is kept, if any. Forward order, because a tensor's recompute cost depends
    only on what is recomputed above it (its chain stops at the first host copy), so each decision is made
    knowing the cost of its own chain. The groups cover the one non-local effect that matters: an intermediate
    that nobody copies (a BatchNormalization output only an activation reads) pays only together with its
    reader. Both corners (recompute nothing, recompute every candidate) are evaluated too, and the fastest of
    the three is returned. An exact search over a chain with skips (a dynamic program over segments, an ILP)
    would cost more planning time than ``wrap()`` can spend, for a cost function (the overlapped step-time
    model) that is not additive over tensors anyway.

    Args:
        candidates: producer index -> ``RecomputeSource`` (only ``chosen`` ones are candidates).
        step_seconds: ``recomputed (frozenset of producer indices) -> predicted step seconds``.
        fits: ``recomputed -> bool`` (the memory model); None: every choice fits.
        start: producers chosen before the search (those of a plan being re-planned with fewer tensors copied,
            which may fit the budget only with them); the search adds to them and the local search may drop them.

    Returns:
        The chosen producer indices.
    """
    fits = fits or (lambda recomputed: True)
    order = sorted(p for p, source in candidates.items() if source.chosen)
    producer_of = {candidates[p].key: p for p in order}
    parents = {p: [producer_of[k] for k, _ in candidates[p].inputs if k in producer_of] for p in order}
    chosen = frozenset(p for p in start if p in producer_of.values())
    best = step_seconds(chosen)
    for p in order:
        if p in chosen:
            continue
        group, frontier, options = [p], list(parents[p]), [frozenset([p])]
        while frontier and len(group) < CHAIN_DEPTH:
            q = frontier.pop(0)
            if q in chosen or q in group:
                continue
            group.append(q)
            options.append(frozenset(group))
            frontier.extend(parents[q])
        taken = None
        for option in options:
            trial = chosen | option
            if fits(trial):
                seconds = step_seconds(trial)
                if seconds < best:
                    best, taken = seconds, option
        if taken is not None:
            chosen = chosen | taken
    every = frozenset(order)
    if every != chosen and every and fits(every):
        seconds = step_seconds(every)
        if seconds < best:
            log.info("keras-lms: recomputing every candidate beats the greedy choice.")
            chosen, best = every, seconds
    return refine(chosen, best, order, step_seconds, fits)


# Rounds of single flips ``refine`` tries after the greedy pass (each round costs one step-time prediction per
# candidate, about 7 ms for the 3D U-Net's 40 candidates).
REFINE_ROUNDS = 3


def refine(chosen: frozenset, best: float, order, step_seconds, fits) -> frozenset:
    """Local search after the greedy pass: flip one candidate at a time (recompute it, or copy it again) and keep
    every flip that shortens the predicted step, for up to ``REFINE_ROUNDS`` rounds or until no flip helps.

    Why: the greedy pass decides each tensor in forward order, before the decisions below it. A U-Net's skip
    tensor is decided at its encoder level, when recomputing it looks cheap; once the decoder recomputes the
    tensors that read it, every one of their windows recomputes the skip's chain again, and copying the skip
    once becomes the cheaper choice. A flip sees the whole plan's step time."""
    for _ in range(REFINE_ROUNDS):
        improved = False
        for p in order:
            trial = chosen - {p} if p in chosen else chosen | {p}
            if not fits(trial):
                continue
            seconds = step_seconds(trial)
            if seconds < best - 1e-9:
                chosen, best, improved = trial, seconds, True
        if not improved:
            break
    return chosen
