"""The memory model: a training step's device memory, position by position, from its traced layer calls.

The model is static and simple on purpose, so users can reason about it (and ``keras-lms report`` shows it): a
step is 2n positions (n layer calls forward, then their backward in reverse). A tensor occupies the device from
its producer's call until its last use: its last forward consumer, or — if a consumer keeps it for the backward
pass (not offloaded) — that consumer's backward. What a backward keeps is what the framework's gradient reads
(``BackendFacts.backward_reads``): nothing for shape-only layers (Add, Concatenate, reshapes), the output for
activation layers differentiated from their output, input and output for max pooling and for Dense/Conv-family
layers with such a fused activation, the inputs otherwise. With LMS:

- an offloaded input is brought back for its consumer's backward. With ``prefetch`` the copy is triggered
  ``prefetch`` calls early but lands on the device only once it has arrived: during the trigger's backward
  when that is a convolution or matmul (long enough to cover the copy), after it otherwise;
- a call whose gradient reads its own output reads its consumer's host copy when there is one
  (``BackendFacts.reads_output_host_copy``): that swap-in is held on until the call's backward;
- an offloaded call that recomputes its output (max pooling; every call on some back ends) holds the
  recomputed output, and what the framework saves in the recompute, as backward temporaries.

Each backward position also holds the gradients of the call's inputs and outputs, plus the temporaries of its
kind (``BackendFacts.backward_temporaries``: normalization layers hold three more input-sized buffers). Static
memory (weights, gradients, optimizer state, and what the back end holds the whole step) is added on top.

Everything that differs between frameworks is asked of the back end's ``BackendFacts`` (backend_facts.py); each
back end's facts say what they were calibrated against: the graph TensorFlow executes, scheduled on a virtual
GPU (``benchmarks/simulated_gpu_peak.py``, within 15% on the U-Nets and the ResNet there), and the live tensor
storages of a torch step (``benchmarks/torch_cpu_peak.py``, within 15% on the U-Nets, plain and wrapped).
``peak_bytes`` is that prediction, with no margin. The budget planner alone adds ``BUDGET_MARGIN`` to the
activation peak before comparing with ``device_budget``: the simulation has no allocator rounding or
fragmentation, no cuDNN workspaces, and copies back that land earlier than it schedules them.
"""

from __future__ import annotations

import dataclasses

from keras_lms.planning import layer_facts
from keras_lms.planning.plan import chosen_sweeps, lead_of, tensor_bytes
from keras_lms.planning.recompute import active_sources

# Safety margin on the activation peak for the planner's budget decisions only (not in reported predictions):
# allocator rounding/fragmentation, cuDNN workspaces and early copies back, which the calibration reference
# (the simulated executed graph) does not model. CPU allocator peaks were 9-12% above the tensor-level model.
BUDGET_MARGIN = 1.15


@dataclasses.dataclass
class StepMemory:
    """Predicted device memory of one training step (bytes)."""

    static_bytes: int
    timeline: list  # device activation bytes at each of the 2n positions (forward, then backward)
    update_bytes: int = 0  # the optimizer update's temporaries, after the backward pass

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.timeline, default=0)

    @property
    def peak_bytes(self) -> int:
        """The predicted device peak: static bytes plus the activation peak or the update's temporaries."""
        return self.static_bytes + max(self.activation_peak_bytes, self.update_bytes)

    @property
    def budget_bytes(self) -> int:
        """What the budget planner compares with ``device_budget``: the peak with BUDGET_MARGIN on activations."""
        return self.static_bytes + max(int(self.activation_peak_bytes * BUDGET_MARGIN), self.update_bytes)


# Positions after its trigger's backward starts at which a prefetched copy back lands on the device when the
# trigger's backward is short (not a convolution/matmul): the copy outlasts it.
SWAP_IN_ARRIVAL = 1

def _is_kernel(unit) -> bool:
    return layer_facts.is_keras_class(unit, layer_facts.KERNEL_LAYERS)


def tensor_sizes(calls, batch_size: int):
    """Per call: its input sizes, its output sizes and its outputs' keys (bytes at ``batch_size``)."""
    sizes_in, sizes_out, keys_out = [], [], []
    for i, call in enumerate(calls):
        sizes_in.append([tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)])
        sizes_out.append([tensor_bytes(s, d, batch_size)
                          for s, d in zip(call.output_shapes, call.output_dtypes)])
        keys = list(call.output_keys) or [("out", i, j) for j in range(len(call.output_shapes))]
        keys_out.append(keys)
    return sizes_in, sizes_out, keys_out


def simulate(calls, offloaded, facts, batch_size: int = 1, prefetch: int = 1, static_bytes: int = 0,
             arrival: int = SWAP_IN_ARRIVAL, unwrapped: bool = False, update_bytes: int = 0,
             lean_normalization: bool = True, slab_bytes: int = 0, recomputed=frozenset(),
             swept=None, short_chains=frozenset()) -> StepMemory:
    """Device memory timeline for a plan; ``offloaded[i][j]`` says whether input j of call i goes to host.

    See the module docstring for what each call holds. ``facts`` is the back end's ``BackendFacts``
    (``Backend.memory_facts()``): everything here that differs between frameworks is asked of it.
    ``unwrapped=True`` models the model without keras-lms (``BackendFacts.plain_model_keeps_layer_outputs``).
    ``update_bytes`` are the optimizer update's temporaries (``BackendFacts.update_temporary_bytes``).
    ``lean_normalization`` is ``LMSConfig.lean_normalization`` (``BackendFacts.lean_normalization_call``).
    ``slab_bytes`` is ``LMSConfig.slab_bytes``: offloaded local calls larger than a slab are computed in slabs
    where the back end plans them (``BackendFacts.slab_plans``). ``recomputed``: the calls whose outputs are
    recomputed instead of copied (``planning.recompute``). A recomputed tensor occupies its reader's backward as
    its copy back would have; read whole, its recompute also holds its source's inputs, brought back from the
    reader's copy-back position on (until the source's ``shared_reader`` takes them over, or the reader's
    backward ends), and its temporaries. Read in windows (TensorFlow's slabs), it lives like a slab window and
    is not charged separately. ``swept``: the level sweeps the plan runs, first call -> windows
    (``plan.planned_sweeps``; ``BackendFacts.slab_sweeps``): their calls hold in their backward what
    ``BackendFacts.sweep_backward_bytes`` says, and nothing of the run is brought back whole. ``short_chains``:
    the activations whose backward recomputes their output from their BatchNorm's input copy
    (``plan.planned_short_chains``), holding ``BackendFacts.short_chain_bytes`` more.
    """
    n = len(calls)
    positions = 2 * n
    if n == 0:
        return StepMemory(static_bytes, [], update_bytes)
    sizes_in, sizes_out, keys_out = tensor_sizes(calls, batch_size)
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes)
    elided = facts.elided_concatenations(calls, slabs, batch_size)  # never built: its reader reads parts
    read_in_parts = {reader: concatenation for concatenation, reader in elided.items()}
    sources = {}
    chains = facts.fused_slab_chains(calls, offloaded, slabs, short_chains) if slabs else {}
    if recomputed:
        sources = active_sources(facts.recompute_sources(calls, offloaded, slabs, chains, batch_size), recomputed)
    held_in_sweeps, planned = {}, chosen_sweeps(facts, calls, offloaded, slabs, swept)
    timings = [facts.sweep_timing(calls, sweep, sizes_in) for sweep in planned]
    passes = frozenset().union(*(t.passes for t in timings))  # long backwards: they convolve
    handed = {call: at for t in timings for call, at in t.handed.items()}
    for sweep in planned:
        held_in_sweeps.update(facts.sweep_backward_bytes(calls, sweep, slabs, sizes_in, sizes_out))
    # a pooling whose input gradient its activation's slab backward takes (a swept one's takes its sweep's pass)
    folds = {p: a for p, (a, _) in facts.pooling_folds(calls, offloaded, slabs).items()
             if p not in held_in_sweeps and a not in held_in_sweeps}
    folded_into = {a: p for p, a in folds.items()}
    info = {}  # key -> [size, first position on the device, last position (None: not consumed by a call)]
    for i, (keys, sizes) in enumerate(zip(keys_out, sizes_out)):
        for key, size in zip(keys, sizes):
            info[key] = [0 if i in elided else size, i, None]
    host_copy = {}  # key -> the first call (forward order) whose backward swaps the host copy back in
    for i, call in enumerate(calls):
        for key, off in zip(call.keys, offloaded[i]):
            if off:
                reads = facts.backward_reads(call.unit)[0]
                host_copy.setdefault(key, None)
                if reads and host_copy[key] is None:
                    host_copy[key] = i
    delta = [0] * (positions + 1)

    def arrives(reader):
        """Position from which the swap-in for ``reader``'s backward occupies the device."""
        lead = lead_of(prefetch, reader)
        if lead <= 0:
            return positions - 1 - reader
        trigger = min(reader + lead, n - 1)
        trigger = handed.get(trigger, trigger)  # a swept call's gradient may exist before its own backward
        # the copy back takes about as long as a short (memory-bound) backward: it lands during the trigger's
        # backward only when that is a convolution/matmul or a sweep's pass (which runs convolutions), else after
        # it (or its memory is allocated when the trigger's backward issues the copy:
        # BackendFacts.copy_back_allocated_at_trigger).
        long = _is_kernel(calls[trigger].unit) or trigger in passes
        late = 0 if facts.copy_back_allocated_at_trigger or long else arrival
        start = positions - 1 - trigger + late
        return min(start, positions - 1 - reader)

    def hold(size, start, end):  # on the device from position start to end, inclusive
        delta[start] += size
        delta[end + 1] -= size

    for i, call in enumerate(calls):
        backward = positions - 1 - i
        reads_inputs, reads_output = facts.backward_reads(call.unit)
        saved = facts.saved_extra_bytes(call.unit, sum(sizes_in[i]), sum(sizes_out[i]))
        if saved and not any(offloaded[i]):
            hold(saved, i, backward)  # what autograd saves besides the inputs and outputs
        if reads_output and i not in slabs and i not in held_in_sweeps:  # windows (slabs, sweeps' passes)
            for key, size in zip(keys_out[i], sizes_out[i]):
                if key in host_copy and facts.reads_output_host_copy(call.unit):
                    # read from the consumer's host copy: the swap-in of its first reader (in forward order, so
                    # the last backward before this one) is held on until this call's backward; without a
                    # reader, this call brings it back itself (prefetch calls early)
                    reader = host_copy[key]
                    start = positions - reader if reader is not None else arrives(i)
                    hold(size, start, backward)
                elif not (any(offloaded[i]) and facts.recomputes_offloaded_output(call.unit)):
                    # kept on the device for this backward (unless an offloaded call recomputes its output)
                    info[key][2] = max(info[key][2] or 0, backward)
        for key, size, off in zip(call.keys, sizes_in[i], offloaded[i]):
            entry = info.setdefault(key, [size, 0, None])  # a model input exists from the start
            last_use = backward if (reads_inputs and not off) else i  # else freed after its forward use
            if i in elided:  # a concatenation nobody builds: its newest part waits for the reader on the device,
                # the older ones (a U-Net skip) are read from their host copies (slabs), not from the device
                if entry[1] < max(info[k][1] for k in call.keys if k in info):
                    continue
                last_use = elided[i]
            entry[2] = last_use if entry[2] is None else max(entry[2], last_use)
            if off and reads_inputs and i not in slabs and i not in held_in_sweeps:  # swapped in, prefetch early
                hold(size, arrives(i), backward)
                if key in sources:
                    _hold_recompute_inputs(sources[key], arrives(i), backward, arrives, hold)
        if i in slabs and i not in held_in_sweeps and i not in folds and reads_inputs:  # (prefetched windows)
            read = [size for key, size, off in zip(call.keys, sizes_in[i], offloaded[i]) if off and key not in sources]
            hold(facts.prefetched_slab_bytes(call, read, slabs[i]), arrives(i), backward - 1)
        # while its backward runs: the gradients of its outputs and inputs, the temporaries of its kind
        # (normalization; layout copies), and the recomputed output of an offloaded call (max pooling, or every
        # call on a back end that recomputes them: BackendFacts.recomputes_offloaded_calls)
        lean = (lean_normalization and any(offloaded[i]) and facts.lean_normalization_call(call.unit, call.dtypes))
        lean_conv = any(offloaded[i]) and facts.lean_convolution_call(call.unit)
        recomputed = any(offloaded[i]) and facts.recomputes_offloaded_output(call.unit) and not (lean or lean_conv)
        in_grads = sum(sizes_in[i])
        if facts.concatenate_gradient_is_view and layer_facts.is_keras_class(call.unit, {"Concatenate"}):
            in_grads = 0  # the input gradients are slices (views) of the output's gradient
        temporaries = 0 if lean_conv else facts.backward_temporaries(call.unit, recomputed, lean)
        grads = in_grads * (1 + temporaries) + sum(sizes_out[i])
        if lean_conv:  # no recompute
            grads += facts.lean_convolution_bytes(call.unit)
        if recomputed:  # the output, recomputed from the inputs brought back, and what the recompute saves
            grads += sum(sizes_out[i]) + saved
        if lean:
            grads += facts.lean_normalization_temporary_bytes(call.shapes[0], call.dtypes[0], batch_size)
        grads += facts.normalization_extra_bytes(call, sizes_in[i])
        grads += facts.backward_layout_bytes(call, sizes_in[i], sizes_out[i])
        if facts.input_freed_before_input_gradient(call):
            grads -= min(sum(sizes_in[i]), in_grads)  # the input's buffer is free before the gradient's
        if i in held_in_sweeps:
            grads = held_in_sweeps[i]
        elif i in slabs:  # a reader of a concatenation's parts assembles their gradients one part at a time
            assembled = sizes_in[read_in_parts[i]] if i in read_in_parts else sizes_in[i]
            grads = facts.slab_backward_bytes(call, assembled, sizes_out[i], slabs[i])
        elif i in elided:
            grads = 0  # no gradient reaches a concatenation nobody reads
        if i in folds:  # it holds its output gradient until its activation's backward, which reads it
            grads = 0
            hold(sum(sizes_out[i]), backward, positions - 1 - folds[i])
        elif i in folded_into:  # one more window: the pooling recomputed and differentiated on it
            grads += sum(sizes_in[folded_into[i]]) // slabs[folded_into[i]].count
        if i in chains and chains[i][1] is None:  # a short chain: its source's outputs recomputed on windows
            source = chains[i][0]
            grads += facts.short_chain_bytes(calls[source], sum(sizes_in[source]), slabs[source])
        hold(grads, backward, backward)
    for i, call in enumerate(calls):  # (once every input's last use is known: what a call's forward frees)
        released = sum(info[key][0] for key in dict.fromkeys(call.keys) if key in info and info[key][2] == i)
        hold(facts.forward_temporaries(call, sizes_in[i], sizes_out[i], slabs.get(i), released), i, i)
    for timing in timings:  # a sweep's first windows land early (prefetch) and are recomputed through the run
        if timing.first_pass is not None:
            hold(timing.early_bytes, arrives(timing.first_pass), positions - 2 - timing.first_pass)
    if facts.gradients_wait_between_readers:
        _hold_waiting_gradients(calls, sizes_out, keys_out, positions, hold, facts.concatenate_gradient_is_view,
                                facts.gradient_sum_allocated, frozenset().union(
                                    *(t.summed for t in timings), *(calls[p].keys for p in folds)))
    if facts.weight_gradients_from_their_backward:
        _release_pending_weight_gradients(calls, positions, hold)
    for size, start, end in info.values():
        end = n if end is None else end  # model outputs live until the loss's backward starts
        if unwrapped and facts.plain_model_keeps_layer_outputs:
            end = max(end, n)
        hold(size, start, end)
    timeline, running = [], 0
    for pos in range(positions):
        running += delta[pos]
        timeline.append(running)
    return StepMemory(static_bytes, timeline, update_bytes)


def _hold_recompute_inputs(source, start: int, backward: int, arrives, hold) -> None:
    """A whole recompute in the backward at position ``backward``: its source's inputs from ``start`` (the
    copy back) until its ``shared_reader``'s own copy back would have landed (that reader holds them from
    there), or until ``backward`` ends; its temporaries during ``backward``."""
    end = backward if source.shared_reader is None else arrives(source.shared_reader) - 1
    for key, size in source.inputs:
        if key not in source.resident:
            hold(size, start, max(end, backward))
    hold(source.temporary_bytes, backward, backward)


def _hold_waiting_gradients(calls, sizes_out, keys_out, positions, hold, concatenate_views: bool,
                            sum_allocated: bool, summed_in_windows=frozenset()):
    """Gradients that wait on the device between backward positions (an autograd engine's input buffers).

    A tensor read by several calls gets its gradient in parts: the first part arrives with the backward of its
    last reader (in forward order) and waits in the producer's input buffer until the backward of its first
    reader has added the last part; the sum then waits for the producer's backward. A U-Net skip tensor's
    gradient arrives with the decoder's concatenation and waits through the whole lower part of the backward;
    where a concatenation's input gradients are views (``concatenate_views``), as a slice of its output
    gradient, which it keeps alive whole. (Adjacent positions are already counted as the gradients of each
    call's inputs and outputs.) The parts of ``summed_in_windows`` are added window by window by a level sweep's
    pass (``SweepTiming.summed``): no sum is allocated.
    """
    produced = {}  # key -> (producer index, bytes)
    for i, (keys, sizes) in enumerate(zip(keys_out, sizes_out)):
        for key, size in zip(keys, sizes):
            produced[key] = (i, size)
    readers = {}
    for i, call in enumerate(calls):
        for key in call.keys:
            if key in produced and i not in readers.setdefault(key, []):
                readers[key].append(i)
    for key, calls_reading in readers.items():
        producer, size = produced[key]
        first, last = min(calls_reading), max(calls_reading)
        if first != last:
            part = size
            if concatenate_views and layer_facts.is_keras_class(calls[last].unit, {"Concatenate"}):
                part = sum(sizes_out[last])
            hold(part, positions - last, positions - 1 - first)
            if sum_allocated and key not in summed_in_windows:
                hold(size, positions - 1 - first, positions - 1 - first)
        if first > producer + 1:  # the summed gradient, until the producer's backward
            hold(size, positions - first, positions - 2 - producer)


def _release_pending_weight_gradients(calls, positions, hold):
    """Weight gradients not yet computed in the backward pass, taken off the timeline (an autograd engine).

    ``static_bytes`` counts one gradient per trainable weight for the whole step. On torch that holds in the
    forward pass (Keras' torch ``train_step`` calls ``zero_grad()``, which drops the previous step's gradients,
    only after the forward pass) and during the optimizer update, but in the backward pass a weight's gradient
    exists from the backward of its layer's last call (forward order) on. Negative holds for the backward
    positions before that.
    """
    last_call = {}  # id(variable) -> (index of the unit's last call, bytes)
    for i, call in enumerate(calls):
        for var in getattr(call.unit, "trainable_variables", ()):
            last_call[id(var)] = (i, variable_bytes([var]))
    n = positions // 2
    for i, size in last_call.values():
        if i < n - 1:  # pending at the backward positions of calls n-1 .. i+1 (positions n .. 2n-2-i)
            hold(-size, n, positions - 2 - i)


def variable_bytes(variables) -> int:
    """Bytes of ``variables`` (any iterable of Keras variables) in their storage dtype."""
    import numpy as np

    return sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype).replace("bfloat16", "float16")).itemsize
               for v in variables)


def static_bytes(model, facts, optimizer=None, default_slots: int = 2) -> int:
    """Weights + gradients + optimizer state, in bytes, plus what the back end holds besides the whole step.

    Optimizer state is read from a built optimizer; otherwise ``default_slots`` copies of the trainable
    weights are assumed (Adam keeps two). ``facts.static_extra_bytes`` adds the back end's own (on TensorFlow,
    the layout optimizer's channels-first copies of the optimizer slots of 5-D kernels).
    """
    weights = variable_bytes(model.variables)
    trainable = variable_bytes(model.trainable_variables)
    if optimizer is not None and getattr(optimizer, "built", False):
        opt_state = variable_bytes(optimizer.variables)
    else:
        opt_state = default_slots * trainable
    return weights + trainable + opt_state + facts.static_extra_bytes(model, optimizer, default_slots)
