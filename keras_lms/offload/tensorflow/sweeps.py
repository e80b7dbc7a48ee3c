"""Level sweeps: a run of ``convolution -> BatchNormalization -> activation`` units differentiated in passes over
slab windows, every pass recomputing the units' forward from the run's one saved input (TensorFlow back end).

Why: a slab-computed step reads every tensor of a U-Net level back (or recomputes it) once per backward that
reads it: BatchNormalization twice (its two passes), the convolution after it once, the activation once, and a
recomputed tensor recomputes its whole chain at each of those reads. At 384^3 float32 that recomputed the
level-0 encoder's second convolution 11.6 times per step (docs/design.md, "Why sweeps"). A sweep reads only
the level's input (a pooled tensor, a concatenation's parts, the image) and recomputes the rest once per pass,
and each pass serves every backward that needs those windows.

The passes, for units ``(conv_j, bn_j, act_j)``, j = 1..m, ``c_j`` the convolution's output, ``r_j`` the
activation's, ``G_j`` the gradient of BatchNorm j's output:

* pass A (in ``act_m``'s backward): per slab, recompute ``c_m`` and ``r_m`` rows from the input's window, take
  ``G_m`` rows from the activation's gradient, and BatchNorm m's first pass (the gradient of its batch mean and
  variance, and of its scale and offset, summed over slabs);
* pass B_j (in ``bn_j``'s backward, j = m..1): per slab, recompute ``c_j``'s rows with the convolution's halo,
  apply BatchNorm j's second pass to them (``dc_j``), differentiate the convolution exactly as an exact-row slab
  does (``slab_rows``: weights from ``dc_j``'s own rows, the input gradient as a transposed convolution), then,
  for j > 1, the activation j-1's gradient (``G_{j-1}`` rows) and BatchNorm j-1's first pass on the same
  recomputed windows; for j = 1 the gradient of the run's input.

The gradients between passes (``G_j``) stay the window pieces the pass before made, each freed once pass B_j has
cut its windows from it (``GRADIENTS_IN_PIECES``: concatenated whole, ``G_j`` was live beside its pieces and then
beside the next gradient's, one level-0 tensor more at every pass); every activation is a window, unless the plan
holds it: a *held* unit's convolution
output ``c_j`` is kept on the device from pass A (which computes it anyway) until pass B_j, and the later passes
slice it instead of convolving again (``Sweep.held``; the planner chooses where the budget has room). Why:
without it a two-unit run convolves its first unit three times and its second twice in the backward; held, once
each, for one whole tensor per held unit on the device. The other backwards of the run return what the passes
handed them (``SweepRun``): the convolution its weight and input gradients, BatchNorm its scale and offset
gradients, an inner activation ``G_j``. The values are the slab backward's: the windows are recomputed with the
forward's batch statistics and weight snapshot, and Dropout (not local) ends a run.

This module finds the runs that can be swept, from the traced calls alone; the planner chooses among them by
the predicted step time on the device profile (``budget``: only with ``device_profile``), records its choice on
the plan (``PlanEntry.sweep``) and ``sweep_calls`` runs them. ``ENABLED = False`` offers none (for comparisons);
``FORCED = True`` sweeps every candidate, with or without a profile (the tests' and benchmarks' switch), and
``HELD_FORCED = True`` then holds every unit it can.

Where the run's output (a U-Net encoder's skip tensor) is read by a tiling pooling and by a concatenation, pass A
also takes the pooling's input gradient, window by window, from its output gradient and the activation rows it
recomputes anyway (``Sweep.folded``). Why: otherwise the pooling's backward assembles that gradient whole from
its slab pieces, and TensorFlow adds it to the concatenation's part in an ``AddN``, so the step held the skip
part, the pooling's pieces, their concatenation and the sum at once: four level-0 tensors, 16.7 GiB at 400^3
float32, the executed graph's peak (docs/design.md, "The skip junction"). Folded, the pooling returns no input
gradient (the concatenation's part alone reaches the activation, no sum) and pass A adds the pooling's share per
window; its windows start on multiples of the pooling's stride (``Sweep.align``). ``FOLD_POOLING = False`` is
the control.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_lms.offload.tensorflow.slab_plan import slab_bounds
from keras_lms.planning import layer_facts
from keras_lms.planning.plan import call_graph

ENABLED = True
FORCED = False
HELD_FORCED = False
FOLD_POOLING = True
# Gradients between a sweep's passes kept as their window pieces (``sweep_calls.SweepCalls._hand_on_gradient``); off:
# concatenated whole (the control of tests/offload/tensorflow/test_sweep_pieces.py).
GRADIENTS_IN_PIECES = True
TILING_POOLINGS = {"MaxPooling2D", "MaxPooling3D", "AveragePooling2D", "AveragePooling3D"}
MAX_UNITS = 2  # units per run: pass B_j recomputes units 1..j, so the recompute grows as m^2 (a U-Net level: 2)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One run of units ``((conv, bn, act), ...)`` (call indices, forward order) differentiated in passes.

    ``windows``: how many slab windows the passes cut the run into (``sweep_windows``: its units' densest slab
    count times ``WINDOW_DIVISOR``); ``window_options``: the counts a planner may choose instead, thinnest first
    (the units' densest slab count: windows as thick as the slabs, fewer halos recomputed, more memory per pass).
    ``held``: the unit numbers (from 1, forward order) whose convolution output the passes hold on the device
    from pass A to their pass B instead of convolving again; ``hold_options``: the sets a planner may choose.
    ``folded``: the pooling call whose input gradient pass A takes (module docstring), or None; ``align``: the
    row multiple its windows start on (that pooling's stride).
    """

    units: tuple
    windows: int = 0
    window_options: tuple = ()
    held: tuple = ()
    hold_options: tuple = ()
    folded: int | None = None
    align: int = 1

    @property
    def calls(self) -> tuple:
        return tuple(i for unit in self.units for i in unit)

    @property
    def first(self) -> int:
        return self.units[0][0]

    @property
    def members(self) -> tuple:
        """The calls whose backward the passes take: the run's, and a folded pooling's."""
        return self.calls + ((self.folded,) if self.folded is not None else ())

    def bounds(self, length: int) -> tuple:
        """The windows' (start, end) rows over ``length`` rows (``sweep_bounds`` with this sweep's ``align``)."""
        return sweep_bounds(length, self.windows, self.align)


def level_sweeps(calls, offloaded, slabs: dict, facts) -> list:
    """The runs of units a sweep can differentiate (module docstring), from the traced calls, the per-call
    offload decisions and the slab plans; empty when ``ENABLED`` is off."""
    if not ENABLED or not slabs:
        return []
    _, consumers = call_graph(calls)
    units = {}
    for v in sorted(slabs):
        unit = _unit(calls, v, offloaded, slabs, consumers, facts)
        if unit is not None:
            units[v] = unit
    following = {}
    for v, (_, _, a) in units.items():
        nxt = consumers.get(calls[a].output_keys[0], [])
        if len(nxt) == 1 and nxt[0] in units:
            following[v] = nxt[0]
    starts = [v for v in units if v not in following.values()]
    runs = []
    for v in starts:
        chain = [v]
        while chain[-1] in following:
            chain.append(following[chain[-1]])
        for k in range(0, len(chain), MAX_UNITS):
            run = tuple(units[c] for c in chain[k:k + MAX_UNITS])
            plans = [slabs[c] for c, _, _ in run] + [slabs[b] for _, b, _ in run]
            thinnest, thickest = sweep_windows(plans), sweep_windows(plans, 1)
            holds = hold_options(calls, run)
            pooling, stride = folded_pooling(calls, run[-1][2], offloaded, consumers, slabs[run[0][0]].length) or (
                None, 1)
            runs.append(Sweep(run, thinnest, tuple(dict.fromkeys((thinnest, thickest))),
                              holds[-1] if HELD_FORCED and holds else (), holds, folded=pooling, align=stride))
    return runs


def folded_pooling(calls, act: int, offloaded, consumers: dict, length: int):
    """``(pooling call, stride)`` when pass A can take the input gradient of the pooling that reads activation
    ``act``'s output (module docstring): the output's readers are that pooling and a concatenation (whose gradient
    part always reaches the activation, so its backward, and pass A, run), the pooling is offloaded (its backward
    is the wrapper's), channels-last, tiling along the sliced axis (pool size = stride: windows on multiples of
    the stride own their pooled rows) and the length is a multiple of the stride; else None."""
    if not FOLD_POOLING:
        return None
    readers = consumers.get(calls[act].output_keys[0], [])
    pools = [i for i in readers if layer_facts.is_keras_class(calls[i].unit, TILING_POOLINGS)]
    others = [i for i in readers if layer_facts.is_keras_class(calls[i].unit, {"Concatenate"})]
    if len(readers) != 2 or len(pools) != 1 or len(others) != 1:
        return None
    p = pools[0]
    unit = calls[p].unit
    if len(calls[p].keys) != 1 or not any(offloaded[p]) or getattr(unit, "data_format", None) != "channels_last":
        return None
    size, stride = tuple(unit.pool_size)[0], tuple(unit.strides)[0]
    if size != stride or length % stride:
        return None
    return p, stride


def _unit(calls, v: int, offloaded, slabs: dict, consumers: dict, facts):
    """``(conv, bn, act)`` when call ``v`` is an exact-row convolution whose output only a slab BatchNorm reads,
    whose output only an activation differentiated from its output reads; else None."""
    plan, conv = slabs[v], calls[v]
    if (plan.moments or not plan.exact_rows or len(conv.output_keys) != 1 or not any(offloaded[v])
            or not layer_facts.is_keras_class(conv.unit, layer_facts.CONV_LAYERS)):
        return None
    readers = consumers.get(conv.output_keys[0], [])
    if len(readers) != 1 or readers[0] not in slabs:
        return None
    b = readers[0]
    bn = calls[b]
    if (not slabs[b].moments or slabs[b].length != plan.length or not any(offloaded[b]) or len(bn.keys) != 1
            or len(bn.output_keys) != 1 or getattr(bn.unit, "activity_regularizer", None) is not None):
        return None
    readers = consumers.get(bn.output_keys[0], [])
    if len(readers) != 1:
        return None
    a = readers[0]
    act = calls[a]
    if (len(act.keys) != 1 or len(act.output_keys) != 1 or facts.output_gradient_activation(act.unit) is None
            or getattr(act.unit, "trainable_variables", None)
            or getattr(act.unit, "activity_regularizer", None) is not None):
        return None
    return v, b, a


def hold_options(calls, units) -> tuple:
    """The sets of units whose convolution outputs a sweep may hold (``Sweep.held``), smallest first: the last
    unit alone (held from pass A to pass B_m, the shortest span) and every unit. Only convolutions without an
    activation of their own: held, pass B_j differentiates convolution j from its input and ``dc_j`` alone, so
    nothing needs its output and TensorFlow prunes the forward convolution the weight gradient is taken of; an
    activation inside the layer would need that output."""
    linear = [j for j, (conv, _, _) in enumerate(units, 1)
              if getattr(calls[conv].unit, "activation", None) in (None, keras.activations.linear)]
    options = [(len(units),), tuple(range(1, len(units) + 1))]
    return tuple(dict.fromkeys(o for o in options if all(j in linear for j in o)))


# A pass holds the windows of every unit it recomputes at once (the run's input, each unit's convolution and
# BatchNorm outputs, widened by the halos below them), where a per-call slab backward holds one call's: at the
# 3D U-Net's slab size that raised the simulated peak at 400^3 float32 from 15.80 to 16.28 GiB. A sweep's
# windows are this many times thinner than its units' slabs, unless the planner finds room in the device budget
# for windows as thick as the slabs (``planning.sweep_plan.plan_sweep_windows``).
WINDOW_DIVISOR = 2


def sweep_windows(plans, divisor: int = WINDOW_DIVISOR) -> int:
    """How many windows a run of units with these slab plans sweeps in: ``divisor`` times as many as its plan
    with the most slabs (the smallest windows), at most one row each."""
    densest = max(plans, key=lambda p: p.count)
    return min(densest.length, densest.count * divisor)


def sweep_bounds(length: int, windows: int, align: int = 1) -> tuple:
    """The (start, end) rows of each of a sweep's ``windows`` windows over ``length`` rows, inner edges multiples
    of ``align`` (``Sweep.align``)."""
    return slab_bounds(length, windows, align)
