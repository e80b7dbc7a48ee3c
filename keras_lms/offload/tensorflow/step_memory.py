"""How a TensorFlow training step holds device memory: the planner's ``BackendFacts`` for this back end.

Calibrated against the grappler-optimised graph a GPU would execute (benchmarks/simulated_gpu_peak.py):

* TensorFlow's registered gradients of Relu, Sigmoid, Tanh and Elu read the activation's output, and AvgPool's
  reads only its input's shape; this back end's output-based kernels (``output_gradients``) also serve fused
  activations, whose backward then reads the output's host copy instead of recomputing the call;
* an offloaded call is not recomputed (graph pruning drops recompute ops no gradient needs), except max pooling,
  whose gradient reads its output;
* grappler's layout optimizer keeps channels-first copies of the optimizer slots of 5-D kernels for the whole
  step (seen as ``adam/Sub_*-TransposeNDHWCToNCDHW-LayoutOptimizer`` buffers);
* the gradient of a tensor read by several calls (a U-Net skip tensor) comes in parts: the decoder's part waits
  on the device until the encoder's backward, where an ``AddN`` sums the parts into a new buffer. At 448^3
  mixed_float16 that junction is the step's peak (skip gradient, max pooling gradient and their sum, 2.68 GiB
  each), which the model missed by 5 GiB before it held them (docs/benchmarks.md, "Gradients in parts").

The planner's memory model (``keras_lms.planning.memory_model.simulate``) counts the tensors a step keeps between
layer calls. Two more things decide the peak of large 3D models:

* **forward temporaries** of a call computed whole: grappler's layout optimiser runs float32 5-D convolutions
  channels-first on a GPU, so such a call holds a transposed copy of its input and of its output (and of the
  bias addition's output) besides the tensors themselves; BatchNormalization holds its centred input and
  normalised output in float32 (three input-sized float32 buffers under mixed precision, where the input is
  float16);
* **slabs** (``LMSConfig.slab_bytes``, ``slabs``, cut where ``slab_plan`` says): an offloaded local call whose input is
  larger than a slab is computed a slab at a time. Its backward holds the output gradient, the input gradient
  being assembled and the slab working set (two windows and their temporaries) instead of the whole swapped-in
  input and whole temporaries; its swap-in is windows, not the whole tensor; a convolution over a channel
  concatenation reads the parts, so the concatenation is never built (nor its gradient).
"""

from __future__ import annotations

import dataclasses

from keras_lms.offload.tensorflow import pooling_folds, recompute_candidates, slab_chains, slab_costs, slab_plan, sweeps
from keras_lms.offload.tensorflow.grappler_estimate import room_for_keeps
from keras_lms.offload.tensorflow.slab_costs import concatenation_parts
from keras_lms.offload.tensorflow.slab_plan import computes_in_slabs_forward, plan_slabs
from keras_lms.planning import BackendFacts, layer_facts
from keras_lms.planning.backend_facts import SweepTiming
from keras_lms.planning.memory_model import variable_bytes
from keras_lms.planning.plan import derived_from_calls, tensor_bytes

# Window-sized buffers a slab's recompute and gradient hold at once besides the pieces (the windows in flight and
# the slab's temporaries), in the compute dtype: BatchNorm under mixed precision works in float32 on float16
# windows. Calibrated on the 3D U-Net's --max-cube edges against benchmarks/simulated_gpu_peak.py (within +8%
# from 208^3 in float32 and from 304^3 in mixed_float16; docs/benchmarks.md).
SLAB_WORKING_WINDOWS = 2
# More windows, in the compute dtype, that a level sweep's pass B_j (j > 1) holds: it applies BatchNorm j's second
# pass and takes BatchNorm j-1's first pass on the same windows. Measured in the executed graph at 448^3
# mixed_float16 with 16 GiB (windows 1/6 of a level-0 tensor): seven float32 and four float16 window-sized
# temporaries at the step's peak, where SLAB_WORKING_WINDOWS counts two (the report was 12% under).
SWEEP_INNER_WORKING_WINDOWS = 4
# More windows that a sweep's pass A and its passes B_j (j > 1) hold beside whole held outputs and gradients in
# pieces (``sweeps.GRADIENTS_IN_PIECES``): the windows convolved with their halo rows and cropped into held pieces,
# the pieces read across a window's edge, the window cuts in flight. Measured in the executed graph at 400^3
# float32 with both units of both level-0 sweeps held: 4 to 5 windows over the model's pass A and B_2.
SWEEP_HELD_WORKING_WINDOWS = 4


def slab_plans(calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
    """Call index -> ``slab_plan.SlabPlan`` for the offloaded calls this back end computes in slabs."""
    if not slab_bytes:
        return {}
    plans = {}
    parts = concatenation_parts(calls, batch_size)
    for i, call in enumerate(calls):
        if not any(offloaded[i]) or any(s is None for shape in call.shapes for s in shape[1:]):
            continue
        shapes = [[batch_size if d is None else d for d in shape] for shape in call.shapes]
        sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        source = parts.get(call.keys[0]) if len(call.keys) == 1 else None
        if source is not None and not layer_facts.is_keras_class(call.unit, {"BatchNormalization"}):
            plan = plan_slabs(call.unit, source[1], sum(source[2]), slab_bytes)
            if plan is not None:
                plans[i] = plan
                continue
        outputs = sum(tensor_bytes(s, d, batch_size) for s, d in zip(call.output_shapes, call.output_dtypes))
        plan = plan_slabs(call.unit, shapes, sum(sizes), slab_bytes, outputs)
        if plan is not None:
            plans[i] = plan
    return pooling_folds.aligned(calls, offloaded, plans, FACTS)  # (a folding activation: its pooling's windows)


def elided_concatenations(calls, plans: dict, batch_size: int) -> dict:
    """Index of a concatenation that is never built -> the slab call that reads its parts instead."""
    parts = concatenation_parts(calls, batch_size) if plans else {}
    return {parts[calls[i].keys[0]][0]: i for i in plans if len(calls[i].keys) == 1 and calls[i].keys[0] in parts}


def _compute_ratio(dtype: str) -> float:
    """float32 bytes per input byte for BatchNormalization's float32 arithmetic on ``dtype`` inputs."""
    return 2.0 if dtype in ("float16", "bfloat16") else 1.0


def _channels_first_convolution(call) -> bool:
    """A float32 5-D convolution, which grappler's layout optimiser runs channels-first on a GPU."""
    five_d = call.shapes and len(call.shapes[0]) == 5
    return bool(five_d and layer_facts.is_keras_class(call.unit, layer_facts.CONV_LAYERS)
                and call.dtypes[0] == "float32")


def backward_layout_bytes(call, sizes_in, sizes_out) -> int:
    """A whole float32 5-D transposed convolution's backward holds a channels-first copy of its input for the
    kernels (grappler's layout optimiser, as in the forward: ``forward_temporaries``): seen in the executed graph
    at 384^3 float32 as ``Conv3DBackpropFilterV2-2-TransposeNDHWCToNCDHW``. Its output gradient (4x its input in
    a U-Net) is not copied again: the decoder's slab reader hands it over unfenced, and the layout optimiser
    assembles it channels-first from window-sized transposes (``SlabCalls._fenced_gradients``). Charged that
    copy too (as before the fence), the model put the 400^3 float32 default plan's peak at the up-sampler's
    backward, 14.78 GiB, against 12.29 executed; now 13.48 (and the 384^3 16 GiB plan within 1%: 13.68 against
    13.82). Not charged to other convolutions: the small 3D U-Nets the report is checked on
    (``tests/offload/tensorflow/test_link_traffic.py``) peak 23% below such a charge."""
    if _channels_first_convolution(call) and "Transpose" in type(call.unit).__name__:
        return sum(sizes_in)
    return 0


def forward_temporaries(call, sizes_in, sizes_out, plan, released: int = 0) -> int:
    """Bytes a call holds only while its forward runs, besides its inputs and outputs (``released``: the bytes of
    its inputs freed once its kernel has run, as their last use before the backward)."""
    unit = call.unit
    if plan is not None:  # slab forward: the pieces of the output, then their concatenation
        if plan.moments or computes_in_slabs_forward(unit):
            window = sum(sizes_in) / plan.count
            return int(sum(sizes_out) + SLAB_WORKING_WINDOWS * window * _compute_ratio(call.dtypes[0]))
        return 0
    if layer_facts.is_keras_class(unit, {"BatchNormalization"}):
        ratio = _compute_ratio(call.dtypes[0])
        return int(sum(sizes_in) * ratio * (3 if ratio > 1 else 1))
    if _channels_first_convolution(call):
        if "Transpose" in type(unit).__name__:
            return transposed_convolution_temporaries(unit, sum(sizes_in), sum(sizes_out), released)
        return sum(sizes_in) + sum(sizes_out)
    return 0


def transposed_convolution_temporaries(unit, input_bytes: int, output_bytes: int, released: int) -> int:
    """A whole float32 5-D transposed convolution's forward temporaries, in its two phases as the executed graph
    runs them: the kernel (the input's channels-first copy beside the channels-first output), then the bias
    addition and the transpose back (the channels-first output, its bias sum and the channels-last result live at
    once: three outputs), by when the input's copy and the input itself, where nothing later reads it, are freed.
    Charged both phases at once (the input's copy and two outputs, besides the input), the model put the 432^3
    float32 default plan's peak at the level-0 up-sampler's forward, 16.95 GiB, where the executed graph holds
    15.06 (three 4.81 GiB outputs) and peaks at 15.22 elsewhere (docs/design.md, "The up-sampler's forward")."""
    copies = 2 if getattr(unit, "use_bias", False) else 1
    return max(input_bytes, copies * output_bytes - released)


def slab_backward_bytes(call, sizes_in, sizes_out, plan, in_pieces: bool = False) -> int:
    """Bytes a slab-computed call's backward holds: the output gradient, the input gradient being assembled
    (pieces, then their concatenation, one part at a time) and the slab working set. ``sizes_in`` are the input
    gradients assembled: for a reader of a concatenation's parts, the parts, concatenated one at a time once the
    output gradient is no longer read (``slabs.backward``). Charged the whole concatenation instead, the
    report's peak at 448^3 mixed_float16 on GH200 was 13.92 GiB against 11.41 in the executed graph."""
    working = slab_working_bytes(call, sizes_in, plan)
    if in_pieces:  # a sweep's pass whose gradients are window pieces: one freed as the other is made
        return int(max(sum(sizes_in), sum(sizes_out)) + working)
    return int(sum(sizes_in) + max(sum(sizes_out), max(sizes_in, default=0)) + working)


def slab_working_bytes(call, sizes_in, plan) -> float:
    """A slab backward's working set (``SLAB_WORKING_WINDOWS`` windows of its input, in the compute dtype)."""
    return SLAB_WORKING_WINDOWS * sum(sizes_in) / plan.count * _compute_ratio(call.dtypes[0])


def sweep_backward_bytes(calls, sweep, slabs: dict, sizes_in, sizes_out) -> dict:
    """Call index -> the bytes its backward holds, for the calls of a level sweep (``sweeps``).

    A pass holds what the slab backward of the call it differentiates holds (the output gradient, the input
    gradient being assembled, the working windows), at the sweep's windows (``Sweep.windows``): pass
    A at the last activation, pass B_j, convolution j's backward, at BatchNorm j. The other calls only hold the
    gradient a pass handed them (a convolution its input gradient, an inner activation ``G_j``). A held unit's
    convolution output (``Sweep.held``) is on the device from pass A to pass B_j: charged to every call of the run
    whose backward runs in between (a run's calls are consecutive: a U-Net level's block). A folded pooling
    (``Sweep.folded``) holds its output gradient until pass A, which recomputes the pooling on one more window.
    With ``sweeps.GRADIENTS_IN_PIECES`` the gradients between passes stay window pieces, each freed once read: a
    pass B_j (j > 1) holds the larger of ``G_j``'s and ``G_{j-1}``'s pieces, not ``G_j`` whole beside
    ``G_{j-1}`` assembled; pass A cuts its upstream gradient into windows at once (both live at its start, the
    gradient freed before the pieces of ``G_m`` and the held outputs grow); a held output is read by its pass B
    as it is freed (docs/design.md, "Gradients in pieces")."""
    units = sweep.units
    plan = slabs[units[0][1]]
    windows = dataclasses.replace(plan, bounds=sweep.bounds(plan.length))
    first = units[0][0]
    parts = concatenation_parts(calls, 1).get(calls[first].keys[0]) if len(calls[first].keys) == 1 else None
    held, working = {}, {}  # working: a pass's windows and temporaries, beside the whole tensors it holds
    pieces = sweeps.GRADIENTS_IN_PIECES
    for j, (conv, bn, act) in enumerate(units, 1):
        held[conv] = sum(sizes_in[conv])
        # the run's input gradient is assembled one part of a concatenation at a time (never concatenated)
        assembled = sizes_in[parts[0]] if j == 1 and parts is not None else sizes_in[conv]
        held[bn] = slab_backward_bytes(calls[conv], assembled, sizes_out[conv], windows, in_pieces=j > 1 and pieces)
        working[bn] = int(slab_working_bytes(calls[conv], assembled, windows))
        if j > 1:  # the pass also takes BatchNorm j-1's first pass on its windows: a second BatchNorm's temporaries
            window = sum(sizes_in[bn]) / max(1, sweep.windows)
            inner = int(SWEEP_INNER_WORKING_WINDOWS * window * _compute_ratio(calls[bn].dtypes[0]))
            held[bn], working[bn] = held[bn] + inner, working[bn] + inner
        held[act] = sum(sizes_in[act])
    last = units[-1][2]
    held[last] = slab_backward_bytes(calls[last], sizes_in[last], sizes_out[last], windows, in_pieces=pieces)
    if sweep.folded is not None:
        held[sweep.folded] = sum(sizes_out[sweep.folded])
        held[last] += int(sum(sizes_in[sweep.folded]) / max(1, sweep.windows))
    for j in sweep.held:
        conv, bn, _ = units[j - 1]
        for i in sweep.calls:
            if bn < i <= last or (i == bn and not pieces):
                held[i] += sum(sizes_out[conv])
    if pieces:
        if sweep.held:
            window = int(SWEEP_HELD_WORKING_WINDOWS * sum(sizes_out[units[-1][0]]) / max(1, sweep.windows))
            held[last] += window
            for _, bn, _ in units[1:]:
                held[bn], working[bn] = held[bn] + window, working[bn] + window
        # pass A cuts every window of its upstream gradient at once (the gradient and its windows, before any piece)
        held[last] = max(held[last], 2 * sum(sizes_out[last]))
        # pass B_j frees its held output's pieces as it reads them, while its own gradient pieces are made:
        for j in sweep.held:  # the held output is live at the pass's start (beside G_j), not with what it makes
            conv, bn, _ = units[j - 1]
            below = sum(sum(sizes_out[units[k - 1][0]]) for k in sweep.held if k < j)  # held through pass B_j
            held[bn] = max(held[bn], sum(sizes_out[bn]) + sum(sizes_out[conv]) + below + working[bn])
    return held


# Windows of a slab backward (or a sweep's first pass) whose copy back only the prefetch trigger gates: each
# later window waits for the one before the previous to finish (``slabs.backward``: ``finished[0]``), so the
# first two land as soon as the trigger's backward starts and wait there for the gradient.
EARLY_WINDOWS = 2


def prefetched_slab_bytes(call, read_sizes, slab) -> int:
    """The early windows of a slab-computed call's backward, as their first reader leaves them: a BatchNorm casts
    a 16-bit window to float32 at once (seen in the executed graph at 448^3 mixed_float16: four level-1 windows,
    1.78 GiB of ``Cast`` ops on ``lms_swap_in_*_bwd_rows*`` live during the level above's backward)."""
    if not read_sizes or slab is None:
        return 0
    ratio = _compute_ratio(call.dtypes[0]) if layer_facts.is_keras_class(call.unit, {"BatchNormalization"}) else 1.0
    return int(sum(read_sizes) / slab.count * min(EARLY_WINDOWS, slab.count) * ratio)


def prefetched_sweep_bytes(calls, sweep, sizes_in) -> int:
    """The early windows of a sweep's first pass, and what is recomputed from them before the gradient comes: per
    window the run's input rows, and the last unit's BatchNorm input in float32 (under mixed precision its cast)
    beside the activation's output (seen in the executed graph: ``lms_sweep_*/Cast`` and ``Relu`` windows)."""
    first, (_, bn, act) = sweep.units[0][0], sweep.units[-1]
    windows = max(1, sweep.windows)
    ratio = _compute_ratio(calls[bn].dtypes[0])
    per_window = (sum(sizes_in[first]) + sum(sizes_in[bn]) * ratio + sum(sizes_in[act])) / windows
    return int(per_window * min(EARLY_WINDOWS, windows))


def normalization_float32_bytes(call, sizes_in) -> int:
    """The float32 share of a whole (not slab-computed) BatchNormalization backward's temporaries beyond what
    ``layer_facts.NORMALIZATION_TEMPORARIES`` input-sized buffers count: under mixed precision Keras computes
    BatchNorm in float32, so each of those temporaries is twice the float16 input."""
    if not layer_facts.is_keras_class(call.unit, {"BatchNormalization"}):
        return 0
    return int(sum(sizes_in) * layer_facts.NORMALIZATION_TEMPORARIES * (_compute_ratio(call.dtypes[0]) - 1))


def layout_copy_bytes(model, optimizer=None, default_slots: int = 2) -> int:
    """The layout optimizer's channels-first copies of the optimizer slots of every 5-D (Conv3D-family) kernel,
    which live from the start of the step to its update (``default_slots`` per kernel for an unbuilt optimizer)."""
    if optimizer is not None and getattr(optimizer, "built", False):
        return variable_bytes(v for v in optimizer.variables if len(v.shape) == 5)
    return default_slots * variable_bytes(v for v in model.trainable_variables if len(v.shape) == 5)


# Slab plans kept per traced call list: its recent (offload decisions, batch, slab size); TensorFlowFacts.slab_plans.
SLAB_PLAN_CACHE = 256


class TensorFlowFacts(BackendFacts):
    """The TensorFlow back end's memory facts (see the module docstring)."""

    output_gradient_activations = frozenset({"relu", "sigmoid", "tanh", "elu"})
    gradients_wait_between_readers = True  # a U-Net skip gradient waits from the decoder down to the encoder,
    gradient_sum_allocated = True  # and is added to the encoder's part by an AddN
    shape_only_layers = layer_facts.STRUCTURAL_LAYERS | layer_facts.AVERAGE_POOLING_LAYERS
    fused_activation_reads_output_copy = True

    def static_extra_bytes(self, model, optimizer=None, default_slots: int = 2) -> int:
        return layout_copy_bytes(model, optimizer, default_slots)

    def normalization_extra_bytes(self, call, input_sizes) -> int:
        return normalization_float32_bytes(call, input_sizes)

    def saved_extra_bytes(self, unit, input_bytes: int, output_bytes: int) -> int:
        # A kept BatchNormalization's gradient reads the float32 cast of a 16-bit input (Keras upcasts it), not
        # the input: twice its bytes, where the model holds the input itself. Seen in the executed graph at
        # 448^3 mixed_float16 (``up1_bn1/Cast:0``, 1.34 GiB live at the peak beside a 0.67 GiB input).
        if layer_facts.is_keras_class(unit, {"BatchNormalization"}):
            return int(input_bytes * (_compute_ratio(str(getattr(unit, "compute_dtype", "float32"))) - 1))
        return 0

    def forward_temporaries(self, call, input_sizes, output_sizes, slab, released: int = 0) -> int:
        return forward_temporaries(call, input_sizes, output_sizes, slab, released)

    def backward_layout_bytes(self, call, input_sizes, output_sizes) -> int:
        return backward_layout_bytes(call, input_sizes, output_sizes)

    def slab_plans(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        # The planner's searches ask for the same plan's slabs hundreds of times (5 ms each at the 3D U-Net's 67
        # calls, a fifth of wrap()'s planning): kept on the first traced call (``RawCall.derived``), as long as it.
        planned = derived_from_calls(calls, "slab_plans", lambda: slab_plans(calls, offloaded, batch_size, slab_bytes),
                                     tuple(map(tuple, offloaded)), batch_size, slab_bytes,
                                     slab_plan.EXACT_ROWS,  # (the comparisons' control flag changes the plans)
                                     limit=SLAB_PLAN_CACHE)
        return dict(planned)

    def elided_concatenations(self, calls, slabs: dict, batch_size: int) -> dict:
        return elided_concatenations(calls, slabs, batch_size)

    def slab_backward_bytes(self, call, input_sizes, output_sizes, slab) -> int:
        return slab_backward_bytes(call, input_sizes, output_sizes, slab)

    def slab_traffic(self, calls, index: int, slab, offloaded_row, batch_size: int):
        return slab_costs.slab_traffic(calls, index, slab, offloaded_row, concatenation_parts(calls, batch_size),
                                       batch_size)

    def slab_flop_factors(self, unit, slab) -> tuple:
        return slab_costs.slab_flop_factors(unit, slab)

    def fused_slab_chains(self, calls, offloaded, slabs: dict, short=frozenset()) -> dict:
        return slab_chains.fused_chains(calls, offloaded, slabs, self, short)

    def short_chain_bytes(self, source_call, source_input_bytes: int, slab) -> int:
        # BatchNorm recomputed on its input's windows in its compute dtype (400^3 float32: +0.48 GiB executed)
        window = source_input_bytes / max(1, slab.count)
        return int(SLAB_WORKING_WINDOWS * window * _compute_ratio(source_call.dtypes[0]))

    def slab_sweeps(self, calls, offloaded, slabs: dict) -> list:
        return sweeps.level_sweeps(calls, offloaded, slabs, self)

    def pooling_folds(self, calls, offloaded, slabs: dict) -> dict:
        return pooling_folds.pooling_folds(calls, offloaded, slabs, self)

    def slab_alignments(self, calls, offloaded, slabs: dict) -> dict:
        return pooling_folds.alignments(calls, offloaded, slabs, self)

    def room_for_keeps(self, calls, batch_size: int, device_budget) -> bool:
        return room_for_keeps(calls, batch_size, device_budget)

    def forced_sweeps(self) -> bool:
        return sweeps.FORCED

    def sweep_backward_bytes(self, calls, sweep, slabs: dict, input_sizes, output_sizes) -> dict:
        return sweep_backward_bytes(calls, sweep, slabs, input_sizes, output_sizes)

    def prefetched_slab_bytes(self, call, read_sizes, slab) -> int:
        return prefetched_slab_bytes(call, read_sizes, slab)

    def sweep_timing(self, calls, sweep, input_sizes) -> SweepTiming:
        # pass A in the last activation's backward, pass B_j in BatchNorm j's, which hands convolution j its gradient
        return SweepTiming(passes=frozenset([bn for _, bn, _ in sweep.units] + [sweep.units[-1][2]]),
                           handed={conv: bn for conv, bn, _ in sweep.units}, first_pass=sweep.units[-1][2],
                           early_bytes=prefetched_sweep_bytes(calls, sweep, input_sizes),
                           summed=frozenset(calls[sweep.folded].keys if sweep.folded is not None else ()))

    def sweep_traffic(self, calls, sweep, slabs: dict, offloaded, batch_size: int):
        return slab_costs.sweep_traffic(calls, sweep, slabs, offloaded, concatenation_parts(calls, batch_size),
                                        batch_size)

    def recompute_sources(self, calls, offloaded, slabs: dict, chains: dict, batch_size: int) -> dict:
        if not slabs:
            return {}  # its recomputes are windows read by slab-computed calls
        return recompute_candidates.recompute_sources(
            calls, offloaded, slabs, chains, concatenation_parts(calls, batch_size),
            elided_concatenations(calls, slabs, batch_size), self, batch_size)


FACTS = TensorFlowFacts()


def memory_facts() -> TensorFlowFacts:
    """The TensorFlow back end's ``BackendFacts`` (the back-end contract's ``memory_facts``)."""
    return FACTS
