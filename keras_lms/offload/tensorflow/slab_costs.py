"""What a slab-computed call moves over the host link and recomputes, on TensorFlow (for the step-time model).

The slab machinery (``slabs``, ``slab_calls``) cuts windows with halos: a slab's backward brings back input rows
``[s0 - 2h, s1 + 2h)`` of every offloaded input, and a BatchNormalization's backward does so twice (its first pass
sums the gradient reaching the batch statistics, its second differentiates each slab with those totals). The
forward of a convolution over a channel concatenation reads the parts older than the newest (a U-Net skip) from
their host copies, rows ``[s0 - h, s1 + h)``. Halos also cost FLOPs: each slab's forward convolves its
``s1 - s0 + 2h`` rows, and its backward convolves the ``s1 - s0 + 4h`` rows of its window for the input and the
weight gradient (zeros outside the slab's own rows still multiply). A plain "same" convolution computes
exactly its slab's rows instead (``slab_rows``): no halo FLOPs but its input gradient's ``2h`` rows, and its
backward reads ``[s0 - h, s1 + h)``.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_lms.offload.tensorflow.slab_plan import computes_in_slabs_forward
from keras_lms.planning import layer_facts
from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.plan import call_graph, derived_from_calls, tensor_bytes
from keras_lms.planning.traffic import SlabTraffic


def _rows(plan, window) -> int:
    return sum(b - a for a, b in (window(s0, s1) for s0, s1 in plan.bounds))


def forward_row_factor(plan) -> float:
    """Rows a slab forward computes, over the rows of the whole call (halos recomputed)."""
    return _rows(plan, plan.forward_window) / plan.length


def backward_row_factor(plan) -> float:
    """Rows a slab backward brings back and differentiates, over the rows of the whole call."""
    return _rows(plan, plan.backward_window) / plan.length


def read_parts(calls, i, parts, batch_size: int):
    """The tensors a slab call reads: a concatenation's parts (``parts``: step_memory.concatenation_parts),
    else its own inputs; as ``(key, bytes, producer index)``."""
    call = calls[i]
    source = parts.get(call.keys[0]) if len(call.keys) == 1 else None
    if source is not None and not layer_facts.is_keras_class(call.unit, {"BatchNormalization"}):
        concat = calls[source[0]]
        producers = _producers(calls)
        return [(k, s, producers.get(k, -1)) for k, s in zip(concat.keys, source[2])], True
    sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
    return [(k, s, -1) for k, s in zip(call.keys, sizes)], False


def concatenation_parts(calls, batch_size: int) -> dict:
    """Output key of a last-axis Concatenate call -> (its index, its input shapes, its input sizes); kept per call
    list (``derived_from_calls``: callers only read it)."""
    return derived_from_calls(calls, "concatenation_parts", lambda: _concatenation_parts(calls, batch_size),
                              batch_size)


def _concatenation_parts(calls, batch_size: int) -> dict:
    out = {}
    for i, call in enumerate(calls):
        if type(call.unit) is not keras.layers.Concatenate or len(call.keys) < 2 or not call.output_keys:
            continue
        rank = len(call.output_shapes[0])
        if call.unit.axis % rank != rank - 1:
            continue
        shapes = [[batch_size if d is None else d for d in shape] for shape in call.shapes]
        sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        out[call.output_keys[0]] = (i, shapes, sizes)
    return out


def _producers(calls) -> dict:
    """Output key -> index of the call that makes it (kept per call list, as ``concatenation_parts``)."""
    return derived_from_calls(calls, "producers", lambda: call_graph(calls)[0])


def slab_traffic(calls, i, plan, offloaded_row, parts, batch_size: int) -> SlabTraffic:
    """The host copies slab call ``i`` reads and the bytes its forward and backward bring back; ``reads`` lists
    them per tensor (rows and windows), for the traffic model to expand where a tensor is recomputed."""
    unit = calls[i].unit
    if layer_facts.standalone_activation(unit) is not None and not getattr(unit, "trainable_variables", None):
        return SlabTraffic((), 0, 0)  # its backward reads windows of its output's copy (counted by the caller)
    tensors, concatenated = read_parts(calls, i, parts, batch_size)
    offload = list(offloaded_row) * len(tensors) if concatenated else list(offloaded_row)
    copied = tuple((k, s) for (k, s, _), off in zip(tensors, offload) if off)
    passes = 2 if plan.moments else 1
    backward_rows = _rows(plan, plan.backward_window)
    reads = [(k, s, backward_rows * passes, plan.count * passes, "bwd") for k, s in copied]
    if concatenated:
        newest = max(p for _, _, p in tensors)
        reads += [(k, s, _rows(plan, plan.forward_window), plan.count, "fwd")
                  for (k, s, p), off in zip(tensors, offload) if off and p != newest]
    forward = sum(s * rows / plan.length for _, s, rows, _, kind in reads if kind == "fwd")
    backward = sum(s * rows / plan.length for _, s, rows, _, kind in reads if kind == "bwd")
    return SlabTraffic(copied, int(forward), int(backward), passes, tuple(reads), plan.length)


def slab_flop_factors(unit, plan) -> tuple:
    """(forward, backward) multipliers of a slab-computed kernel call's FLOPs (halos recomputed; for an exact-rows
    convolution, ``slab_rows``, only its input gradient's)."""
    if plan.exact_rows:  # the input gradient (half the backward) convolves the window's rows, the rest the slab's
        return 1.0, (1.0 + forward_row_factor(plan)) / 2
    forward = forward_row_factor(plan) if computes_in_slabs_forward(unit) else 1.0
    return forward, backward_row_factor(plan)


@dataclasses.dataclass(frozen=True)
class SweepTraffic:
    """What a level sweep (``sweeps``) reads and recomputes, per pass owner (the last activation for pass A, each
    BatchNormalization for its pass B): ``reads`` ``(owner, key, bytes, rows read, windows)`` of the run's
    input tensors (a concatenation's parts), ``work`` owner -> ``[kernel FLOPs, element-wise bytes]`` of the
    recomputed forward (and the halo rows the convolution's weight gradient adds), ``length`` rows."""

    first: int
    members: frozenset
    copied: tuple
    reads: tuple
    work: dict
    pieces: int
    length: int


def sweep_traffic(calls, sweep, slabs: dict, offloaded, parts, batch_size: int) -> SweepTraffic:
    """The windows a sweep's passes read and the forward they recompute, slab by slab, as ``sweep_calls`` runs
    them: pass A recomputes every unit on its slab's rows, pass B_j convolution j on the rows its input gradient
    reads (``[s0 - h, s1 + h)``; BatchNorm j is differentiated there, activation j does not run) and the units
    below it on rows widened by each convolution's halo; a held unit (``Sweep.held``) is convolved in pass A
    only; a folded pooling (``Sweep.folded``) is pass A's, and reads no windows of its own."""
    units = sweep.units
    first = units[0][0]
    length = slabs[first].length
    bounds = sweep.bounds(length)
    tensors, concatenated = read_parts(calls, first, parts, batch_size)
    row = list(offloaded[first]) * len(tensors) if concatenated else list(offloaded[first])
    inputs = [(k, s) for (k, s, _), off in zip(tensors, row) if off]
    costs = {i: call_cost(calls[i], batch_size) for i in sweep.calls}
    reads, work = {}, {}
    held = set(sweep.held)
    # TensorFlow prunes the gradient of a model input: such a run's input gradient is never computed
    from_model_input = not any(set(calls[first].keys) & set(c.output_keys) for c in calls[:first])

    def recompute(owner, j, a, b, first_pass=False, activated=True):
        """Unit j's output rows [a, b) recomputed (j = 0: the run's input rows read); a held unit's convolution
        output is sliced after pass A, so only its normalisation and activation run again. Not ``activated``:
        pass B_j's own unit, whose BatchNorm is differentiated there and whose activation does not run."""
        if j == 0:
            for key, _ in inputs:
                reads[(owner, key)] = reads.get((owner, key), 0) + (b - a)
            return
        conv, bn, act = units[j - 1]
        w = work.setdefault(owner, [0.0, 0.0])
        w[1] += (costs[bn].forward_bytes + (costs[act].forward_bytes if activated else 0.0)) * (b - a) / length
        if j in held and not first_pass:
            return
        h = slabs[conv].halo
        w[0] += costs[conv].forward_flops * (b - a) / length
        w[1] += costs[conv].forward_bytes * (b - a) / length
        recompute(owner, j - 1, max(0, a - h), min(length, b + h), first_pass)

    m = len(units)
    for s0, s1 in bounds:
        recompute(units[-1][2], m, s0, s1, first_pass=True)  # pass A
        for j in range(m, 0, -1):  # pass B_j: convolution j on the rows [s0 - h, s1 + h), the units below wider
            conv, bn, _ = units[j - 1]
            h = slabs[conv].halo
            g0, g1 = max(0, s0 - h), min(length, s1 + h)
            recompute(bn, j, g0, g1, activated=False)  # (sweep_calls._sweep_second_pass: no activation j)
            if j in held:  # its output sliced: its input's rows still give the weight gradient
                recompute(bn, j - 1, max(0, g0 - h), min(length, g1 + h))
            # the weight and input gradients over those rows too (an exact-row slab backward: the slab's rows
            # only; the input gradient's transposed convolution runs over dc's rows and is cropped after)
            extra = ((g1 - g0) - (s1 - s0)) / length
            gradients = costs[conv].weight_gradient_flops + (costs[conv].input_gradient_flops
                                                             if j > 1 or not from_model_input else 0.0)
            work[bn][0] += gradients * extra
    if sweep.folded is not None:  # pass A takes the pooling's gradient: it recomputes the pooling, reads nothing
        work.setdefault(units[-1][2], [0.0, 0.0])[1] += call_cost(calls[sweep.folded], batch_size).forward_bytes
    sizes = dict(inputs)
    out = tuple((owner, key, sizes[key], rows, len(bounds)) for (owner, key), rows in sorted(reads.items()))
    return SweepTraffic(first, frozenset(sweep.members), tuple(inputs), out, work, len(bounds), length)
