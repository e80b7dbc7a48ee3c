"""What the planner needs to know of the JAX step's windows of rows (the slab half of ``JaxFacts``).

The JAX step runs an offloaded call over windows of rows where its operands exceed ``LMSConfig.slab_bytes``
(``step``): a stride-1 "same" convolution's forward and backward (``convolutions``, ``convolution_backward``),
a block transposed convolution's forward and backward (``lean``), a BatchNormalization's lean backward
(``lean_norm``). Its backward streams its host residuals a window at a time (``row_windows``), so no input comes
back whole; a convolution that reads a channel concatenation reads the parts instead (the concatenation is never
built), and the parts parked on host since their first reader (``parking``: a U-Net skip) are read from there in
the forward too, their gradients assembled there. Without these facts the report predicted the 3D U-Net's 432^3
float32 step at 24.11 GiB against 15.10 compiled, and ``device_budget="16GiB"`` refused a cube that trains.

The bytes a windowed call holds besides its whole operands (its output gradient, the input gradients assembled
on the device) are ``WORKING_WINDOWS`` windows of its operands: the window's slices, their layout copies and the
float32 temporaries of a 16-bit BatchNorm. Calibrated on the compiled programs (docs/benchmarks.md): with one
window the report's peak is the compiled temp + arguments at the 432^3 float32 cube (15.10 GiB both) and 1.05x
on the 2x96^3 U-Net with 32 MiB slabs (464.4 against 440.2 MiB); with two, 1.02x and 1.18x.
"""

from __future__ import annotations

import dataclasses

import jax

from keras_lms.offload.jax import convolution_backward, convolutions, parking, row_windows
from keras_lms.offload.jax.lean import kernel_and_bias
from keras_lms.offload.jax.lean_norm import lean_layer, normalization_windows
from keras_lms.planning import layer_facts
from keras_lms.planning.plan import tensor_bytes
from keras_lms.planning.traffic import SlabTraffic

__all__ = ["WindowPlan", "PARK_DISTANCE", "WORKING_WINDOWS", "elided_concatenations", "parked_inputs",
           "window_backward_bytes", "window_forward_bytes", "window_plans", "window_traffic"]

# Calls between a tensor's first reader and a concatenation of it beyond which the tensor is parked on host.
PARK_DISTANCE = 2
# Window-sized buffers a windowed call holds at once besides its whole operands (see the module docstring).
WORKING_WINDOWS = 1
# Whether an input gradient of its output gradient's size takes that gradient's place (``row_windows``).
OVERWRITTEN = True


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """How the JAX step cuts one offloaded call: ``count`` windows of ``length`` rows along axis 1 (widened by
    ``halo`` rows each side); its backward reads its host copies ``passes`` times (a BatchNorm's three passes);
    ``host_parts``: the positions of a read concatenation's parts parked on host (``parking``)."""

    count: int
    length: int
    halo: int = 0
    passes: int = 1
    host_parts: tuple = ()
    moments: bool = False  # (TensorFlow's slab plans: a BatchNorm slabbed with batch statistics; none here)


def _shape(shape, batch_size: int) -> list:
    return [batch_size if d is None else d for d in shape]


def _sizes(shapes, dtypes, batch_size: int) -> list:
    return [tensor_bytes(s, d, batch_size) for s, d in zip(shapes, dtypes)]


def _arrays(shapes, dtypes, batch_size: int) -> list:
    """The call's inputs as the step's window counts take them (shape and dtype only)."""
    return [jax.ShapeDtypeStruct(tuple(_shape(s, batch_size)), d) for s, d in zip(shapes, dtypes)]


def _concatenations(calls) -> dict:
    """Output key of a channel (last-axis) Concatenate call of several parts -> its index."""
    found = {}
    for i, call in enumerate(calls):
        if (layer_facts.is_keras_class(call.unit, {"Concatenate"}) and len(call.keys) > 1
                and len(call.output_keys) == 1 and call.unit.axis in (-1, len(call.output_shapes[0]) - 1)):
            found[call.output_keys[0]] = i
    return found


def _read_concatenations(calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
    """Concatenation index -> (index of the offloaded convolution that reads its parts in windows, windows)."""
    if not (slab_bytes and convolutions.SPLIT_PARTS):
        return {}
    concatenations, read = _concatenations(calls), {}
    readers = {}
    for i, call in enumerate(calls):
        for key in call.keys:
            readers.setdefault(key, []).append(i)
    for key, c in concatenations.items():
        reader = readers.get(key, [])
        if len(reader) != 1 or not any(offloaded[reader[0]]) or len(calls[reader[0]].keys) != 1:
            continue
        call = calls[c]
        windows = convolutions.window_count(calls[reader[0]].unit, _arrays(call.shapes, call.dtypes, batch_size),
                                            slab_bytes)
        if windows > 1 and convolution_backward.WINDOWED and kernel_and_bias(calls[reader[0]].unit) is not None:
            read[c] = (reader[0], windows)  # (parts read from host need its windowed backward: ``step``)
    return read


def _parked_parts(calls, c: int) -> list:
    """(part position, first reader index, input position there) of concatenation ``c``'s parks (``parking``)."""
    if not parking.PARKED:
        return []
    first = {}
    for i, call in enumerate(calls[:c]):
        for j, key in enumerate(call.keys):
            first.setdefault(key, (i, j))
    return [(p, *first[key]) for p, key in enumerate(calls[c].keys)
            if key in first and first[key][0] + PARK_DISTANCE < c]


def parked_inputs(calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
    """Call index -> positions of its inputs parked on host after it (``BackendFacts.parked_inputs``)."""
    parked = {}
    for c in _read_concatenations(calls, offloaded, batch_size, slab_bytes):
        for _, i, j in _parked_parts(calls, c):
            parked.setdefault(i, set()).add(j)
    return {i: sorted(j) for i, j in parked.items()}


def window_plans(calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
    """Call index -> `WindowPlan` of the offloaded calls the JAX step runs in windows of rows."""
    if not slab_bytes:
        return {}
    plans = {}
    for c, (reader, windows) in _read_concatenations(calls, offloaded, batch_size, slab_bytes).items():
        plans[reader] = WindowPlan(windows, _shape(calls[c].shapes[0], batch_size)[1],
                                   convolutions.halos(calls[reader].unit)[0],
                                   host_parts=tuple(p for p, _, _ in _parked_parts(calls, c)))
    for i, call in enumerate(calls):
        if i in plans or not any(offloaded[i]) or not call.shapes or any(d is None for d in call.shapes[0][1:]):
            continue
        unit, shape = call.unit, _shape(call.shapes[0], batch_size)
        if len(shape) < 3:
            continue
        arrays = _arrays(call.shapes, call.dtypes, batch_size)
        windows, halo, passes = convolutions.window_count(unit, arrays, slab_bytes), 0, 1
        if windows > 1:
            halo = convolutions.halos(unit)[0]
        elif len(arrays) == 1:  # (the step's own counts: ``step``, ``lean``, ``lean_norm``)
            windows = convolutions.transposed_window_count(unit, arrays, slab_bytes)
            if windows <= 1 and lean_layer(unit, call.dtypes[0]) and row_windows.row_axis(len(shape), [unit.axis]) == 1:
                windows, passes = normalization_windows(unit, arrays[0], slab_bytes), 3
        if windows > 1:
            plans[i] = WindowPlan(windows, shape[1], halo, passes)
    return plans


def elided_concatenations(calls, plans: dict, batch_size: int) -> dict:
    """Index of a concatenation never built -> the windowed convolution that reads its parts instead."""
    concatenations = _concatenations(calls)
    return {concatenations[calls[i].keys[0]]: i for i in plans
            if len(calls[i].keys) == 1 and calls[i].keys[0] in concatenations
            and convolutions.windowable(calls[i].unit)}


def _compute_ratio(call) -> float:
    """A 16-bit BatchNorm's windows are float32 too (Keras computes it in float32)."""
    norm = layer_facts.is_keras_class(call.unit, {"BatchNormalization"})
    return 2.0 if norm and call.dtypes[0] in ("float16", "bfloat16") else 1.0


def window_backward_bytes(call, input_sizes, output_sizes, plan: WindowPlan) -> int:
    """A windowed call's backward: its output gradient, the input gradients assembled on the device (a parked
    part's is assembled on host; one of the output gradient's size is written in its place: ``row_windows``'
    ``overwrite``) and the working windows."""
    device = [s for p, s in enumerate(input_sizes) if p not in plan.host_parts]
    in_place = sum(output_sizes) if OVERWRITTEN and sum(output_sizes) in device else 0
    window = (sum(input_sizes) + sum(output_sizes)) / plan.count
    return int(sum(output_sizes) + sum(device) - in_place + WORKING_WINDOWS * window * _compute_ratio(call))


def window_forward_bytes(call, input_sizes, output_sizes, plan: WindowPlan) -> int:
    """A windowed call's forward besides its inputs and output: the working windows."""
    return int(WORKING_WINDOWS * (sum(input_sizes) + sum(output_sizes)) / plan.count)


def window_traffic(calls, index: int, plan: WindowPlan, offloaded_row, batch_size: int) -> SlabTraffic:
    """The host copies a windowed call reads and the bytes it brings back: its backward reads each copy
    ``passes`` times with its halos; a convolution over parked parts reads them in its forward too."""
    call = calls[index]
    concatenations = _concatenations(calls)
    c = concatenations.get(call.keys[0]) if len(call.keys) == 1 else None
    if c is not None and convolutions.windowable(call.unit):
        keys, sizes = calls[c].keys, _sizes(calls[c].shapes, calls[c].dtypes, batch_size)
        offload = [bool(offloaded_row[0])] * len(keys)
    else:
        keys, sizes, offload = call.keys, _sizes(call.shapes, call.dtypes, batch_size), list(offloaded_row)
    copied = tuple((k, s) for k, s, off in zip(keys, sizes, offload) if off)
    rows = plan.length + 2 * plan.halo * (plan.count - 1)  # each window widened by its halo inside the tensor
    reads = [(k, s, rows * plan.passes, plan.count * plan.passes, "bwd") for k, s in copied]
    reads += [(keys[p], sizes[p], rows, plan.count, "fwd") for p in plan.host_parts]
    forward = sum(s * r / plan.length for _, s, r, _, kind in reads if kind == "fwd")
    backward = sum(s * r / plan.length for _, s, r, _, kind in reads if kind == "bwd")
    return SlabTraffic(copied, int(forward), int(backward), plan.passes, tuple(reads), plan.length)
