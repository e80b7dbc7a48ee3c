"""The budget planner: predict a training step's device memory and offload only what the budget needs.

The memory model is static and simple on purpose, so users can reason about it (and ``keras-lms report``
shows it): a step is 2n positions (n layer calls forward, then their backward in reverse). A tensor occupies
the device from its producer's call until its last use: its last forward consumer, or — if a consumer keeps
it for the backward pass (not offloaded) — that consumer's backward. What a backward keeps is what
TensorFlow's gradient reads (``backward_reads``): nothing for structural layers (Add, Concatenate, reshapes,
average pooling), the output for relu-like activation layers, input and output for max pooling and for
Dense/Conv-family layers with a fused relu-like activation, the inputs otherwise. With LMS:

- an offloaded input is brought back for its consumer's backward. With ``prefetch`` the copy is triggered
  ``prefetch`` calls early but lands on the device only once it has arrived: during the trigger's backward
  when that is a convolution or matmul (long enough to cover the copy), after it otherwise;
- a call whose gradient reads its own output (relu-like layers; fused activations on TensorFlow) reads its
  consumer's host copy when there is one: that swap-in is held on until the call's backward;
- an offloaded max pooling is recomputed from its input (its output is a backward temporary).

Each backward position also holds the gradients of the call's inputs and outputs, plus, for normalization
layers, three more input-sized temporaries. Static memory (weights, gradients, optimizer state, and on
TensorFlow the layout optimizer's copies of the optimizer slots of 5-D kernels) is added on top.

On torch (``layer_facts.saved_extra_bytes`` / ``backward_temporaries``): autograd also saves a channels-first
copy of every convolution's input, normalization's centred input, dropout's mask and max pooling's indices
until the call's backward; an unwrapped Keras functional model keeps every layer output until the forward
pass returns; an offloaded call is recomputed in its backward; and Adam-like optimizer updates hold three
weight-sized temporaries (``update_temporary_bytes``). Calibrated against the live tensor storages of a
training step (benchmarks/torch_cpu_peak.py): within 15% on the U-Nets there, plain and wrapped.

Calibrated against the graph TensorFlow executes, not the graph we build: ``benchmarks/simulated_gpu_peak.py``
schedules the grappler-optimised step on a virtual GPU and lists the buffers live at its peak; the report's
peak is within 15% of it on the U-Nets and the ResNet there (docs/benchmarks.md). ``peak_bytes`` is that
prediction, with no margin. The budget planner alone adds ``BUDGET_MARGIN`` to the activation peak before
comparing with ``device_budget``: the simulation has no allocator rounding or fragmentation, no cuDNN
workspaces, and copies back that land earlier than it schedules them.

Choice: largest and longest-lived tensors first (bytes x distance to their backward use), the last layers
stay resident (``keep_last``), until the predicted peak (with the margin) fits; nothing is offloaded when the
step fits anyway; when even full offload cannot fit, the error names the largest single layer call.
"""

from __future__ import annotations

import dataclasses
import logging

from keras_lms import layer_facts, policy, tf_step_memory
from keras_lms.config import format_bytes

log = logging.getLogger(__name__)

# Safety margin on the activation peak for the planner's budget decisions only (not in reported predictions):
# allocator rounding/fragmentation, cuDNN workspaces and early copies back, which the calibration reference
# (the simulated executed graph) does not model. CPU allocator peaks were 9-12% above the tensor-level model.
BUDGET_MARGIN = 1.15
ACTIVATION_OVERHEAD = BUDGET_MARGIN  # the name before the calibration against the executed graph


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


class BudgetError(ValueError):
    """The step cannot fit the device budget even with every eligible tensor offloaded."""


# Positions after its trigger's backward starts at which a prefetched copy back lands on the device when the
# trigger's backward is short (not a convolution/matmul): the copy outlasts it.
SWAP_IN_ARRIVAL = 1

# The layer facts live in keras_lms.layer_facts (shared with the report and the back ends).
backward_reads = layer_facts.backward_reads
backward_temporaries = layer_facts.backward_temporaries


def _is_kernel(unit) -> bool:
    return layer_facts.is_keras_class(unit, layer_facts.KERNEL_LAYERS)


def _is_max_pooling(unit) -> bool:
    return layer_facts.is_keras_class(unit, layer_facts.MAX_POOLING_LAYERS)


def _reads_output_host_copy(unit, backend: str) -> bool:
    """Whether the wrapped backward reads the call's output from its consumer's host copy (when one exists)
    instead of keeping it on the device: activation layers whose gradient ``backend`` computes from the output
    (``layer_facts.OUTPUT_GRADIENT_ACTIVATIONS``, the table both back ends' kernels read), and on TensorFlow
    fused relu-like activations too (keras_lms/offload/tf_output_gradients.py; torch recomputes those). Max
    pooling is recomputed from its input instead."""
    if layer_facts.output_gradient_activation(unit, backend) is not None:
        return True
    return backend == "tensorflow" and layer_facts.fused_output_activation(unit, backend) is not None


def _tensors(calls, batch_size):
    sizes_in, sizes_out, keys_out = [], [], []
    for i, call in enumerate(calls):
        sizes_in.append([policy.tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)])
        sizes_out.append([policy.tensor_bytes(s, d, batch_size)
                          for s, d in zip(call.output_shapes, call.output_dtypes)])
        keys = list(call.output_keys) or [("out", i, j) for j in range(len(call.output_shapes))]
        keys_out.append(keys)
    return sizes_in, sizes_out, keys_out


def simulate(calls, offloaded, batch_size: int = 1, prefetch: int = 1, static_bytes: int = 0,
             arrival: int = SWAP_IN_ARRIVAL, backend: str | None = None, unwrapped: bool = False,
             update_bytes: int = 0, lean_normalization: bool = True, slab_bytes: int = 0) -> StepMemory:
    """Device memory timeline for a plan; ``offloaded[i][j]`` says whether input j of call i goes to host.

    Calibrated against the graph TensorFlow executes (benchmarks/simulated_gpu_peak.py) and, on torch, against
    the live tensor storages of a step (benchmarks/torch_cpu_peak.py): see the module docstring for what each
    call holds. ``unwrapped=True`` models the model without keras-lms: on torch, Keras' functional model
    keeps every layer output until its forward pass returns (a wrapped model frees each after its last use).
    ``update_bytes`` are the optimizer update's temporaries (:func:`update_temporary_bytes`).
    ``lean_normalization`` is ``LMSConfig.lean_normalization`` (on torch: offloaded BatchNormalization calls
    are differentiated without recompute, ``layer_facts.lean_normalization_call``).
    ``slab_bytes`` is ``LMSConfig.slab_bytes``: on TensorFlow, offloaded local calls larger than a slab are
    computed in slabs (``keras_lms.tf_step_memory``, which also adds TensorFlow's forward temporaries).
    """
    import keras

    backend = backend or keras.backend.backend()
    n = len(calls)
    positions = 2 * n
    if n == 0:
        return StepMemory(static_bytes, [], update_bytes)
    sizes_in, sizes_out, keys_out = _tensors(calls, batch_size)
    slabs = tf_step_memory.slab_plans(calls, offloaded, batch_size, slab_bytes, backend)
    elided = tf_step_memory.elided_concatenations(calls, slabs, batch_size)  # never built: its reader reads parts
    info = {}  # key -> [size, first position on the device, last position (None: not consumed by a call)]
    for i, (keys, sizes) in enumerate(zip(keys_out, sizes_out)):
        for key, size in zip(keys, sizes):
            info[key] = [0 if i in elided else size, i, None]
    host_copy = {}  # key -> the first call (forward order) whose backward swaps the host copy back in
    for i, call in enumerate(calls):
        for key, off in zip(call.keys, offloaded[i]):
            if off:
                reads = backward_reads(call.unit, backend)[0]
                host_copy.setdefault(key, None)
                if reads and host_copy[key] is None:
                    host_copy[key] = i
    delta = [0] * (positions + 1)

    def arrives(reader):
        """Position from which the swap-in for ``reader``'s backward occupies the device."""
        if prefetch <= 0:
            return positions - 1 - reader
        trigger = min(reader + prefetch, n - 1)
        # the copy back takes about as long as a short (memory-bound) backward: it lands during the trigger's
        # backward only when that is a convolution/matmul, else after it. On torch its memory is allocated on
        # the compute stream when the trigger's backward issues the copy.
        late = 0 if backend == "torch" or _is_kernel(calls[trigger].unit) else arrival
        start = positions - 1 - trigger + late
        return min(start, positions - 1 - reader)

    def hold(size, start, end):  # on the device from position start to end, inclusive
        delta[start] += size
        delta[end + 1] -= size

    for i, call in enumerate(calls):
        backward = positions - 1 - i
        reads_inputs, reads_output = backward_reads(call.unit, backend)
        saved = layer_facts.saved_extra_bytes(call.unit, sum(sizes_in[i]), sum(sizes_out[i]), backend)
        if saved and not any(offloaded[i]):
            hold(saved, i, backward)  # what autograd saves besides the inputs and outputs
        if reads_output and i not in slabs:  # a slab call reads windows of the output's host copy
            for key, size in zip(keys_out[i], sizes_out[i]):
                if key in host_copy and _reads_output_host_copy(call.unit, backend):
                    # read from the consumer's host copy: the swap-in of its first reader (in forward order, so
                    # the last backward before this one) is held on until this call's backward; without a
                    # reader, this call brings it back itself (prefetch calls early)
                    reader = host_copy[key]
                    start = positions - reader if reader is not None else arrives(i)
                    hold(size, start, backward)
                elif not (any(offloaded[i]) and (_is_max_pooling(call.unit) or backend == "torch")):
                    # kept on the device for this backward (on torch an offloaded call recomputes its output)
                    info[key][2] = max(info[key][2] or 0, backward)
        for key, size, off in zip(call.keys, sizes_in[i], offloaded[i]):
            entry = info.setdefault(key, [size, 0, None])  # a model input exists from the start
            last_use = backward if (reads_inputs and not off) else i  # else freed after its forward use
            if i in elided:  # a concatenation nobody builds: its newest part waits for the reader on the device,
                # the older ones (a U-Net skip) are read from their host copies (tf_slabs), not from the device
                if entry[1] < max(info[k][1] for k in call.keys if k in info):
                    continue
                last_use = elided[i]
            entry[2] = last_use if entry[2] is None else max(entry[2], last_use)
            if off and reads_inputs and i not in slabs:  # swapped in for its backward, prefetch calls early
                hold(size, arrives(i), backward)
        # while its backward runs: the gradients of its outputs and inputs, the temporaries of its kind
        # (normalization; layout copies on torch), and the recomputed output of an offloaded call (max pooling
        # on TensorFlow, where other offloaded calls differentiate without their output; every one on torch)
        lean = (lean_normalization and any(offloaded[i])
                and layer_facts.lean_normalization_call(call.unit, call.dtypes, backend))
        lean_conv = any(offloaded[i]) and layer_facts.lean_convolution_call(call.unit, backend)
        recomputed = (any(offloaded[i]) and (_is_max_pooling(call.unit) or backend == "torch")
                      and not (lean or lean_conv))
        in_grads = sum(sizes_in[i])
        if backend == "torch" and layer_facts.is_keras_class(call.unit, {"Concatenate"}):
            in_grads = 0  # torch's cat backward returns slices (views) of the output's gradient
        temporaries = 0 if lean_conv else backward_temporaries(call.unit, backend, recomputed, lean)
        grads = in_grads * (1 + temporaries) + sum(sizes_out[i])
        if lean_conv:  # no recompute: the kernel's channels-last copy only
            grads += layer_facts.kernel_copy_bytes(call.unit)
        if recomputed:  # the output, recomputed from the inputs brought back
            grads += sum(sizes_out[i])
            if backend == "torch":  # and what autograd saves in the recompute (see saved_extra_bytes)
                grads += saved
        if lean:  # one or two float32 slabs
            grads += layer_facts.lean_normalization_temporary_bytes(call.shapes[0], call.dtypes[0], batch_size)
        grads += tf_step_memory.normalization_float32_bytes(call, sizes_in[i], backend)
        if i in slabs:
            grads = tf_step_memory.slab_backward_bytes(call, sizes_in[i], sizes_out[i], slabs[i])
        elif i in elided:
            grads = 0  # no gradient reaches a concatenation nobody reads
        hold(grads, backward, backward)
        hold(tf_step_memory.forward_temporaries(call, sizes_in[i], sizes_out[i], slabs.get(i), backend), i, i)
    if backend == "torch":
        _hold_waiting_gradients(calls, sizes_out, keys_out, positions, hold)
        _release_pending_weight_gradients(calls, positions, hold)
    for size, start, end in info.values():
        end = n if end is None else end  # model outputs live until the loss's backward starts
        if unwrapped and backend == "torch":
            end = max(end, n)
        hold(size, start, end)
    timeline, running = [], 0
    for pos in range(positions):
        running += delta[pos]
        timeline.append(running)
    return StepMemory(static_bytes, timeline, update_bytes)


def _hold_waiting_gradients(calls, sizes_out, keys_out, positions, hold):
    """Gradients that wait on the device between backward positions (torch's autograd engine).

    A tensor read by several calls gets its gradient in parts: the first part arrives with the backward of its
    last reader (in forward order) and waits in the producer's input buffer until the backward of its first
    reader has added the last part; the sum then waits for the producer's backward. A U-Net skip tensor's
    gradient arrives with the decoder's concatenation and waits through the whole lower part of the backward:
    as a slice of the concatenation's output gradient, which it keeps alive whole. (Adjacent positions are
    already counted as the gradients of each call's inputs and outputs.)
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
            if layer_facts.is_keras_class(calls[last].unit, {"Concatenate"}):
                part = sum(sizes_out[last])
            hold(part, positions - last, positions - 1 - first)
        if first > producer + 1:  # the summed gradient, until the producer's backward
            hold(size, positions - first, positions - 2 - producer)


def _release_pending_weight_gradients(calls, positions, hold):
    """Weight gradients not yet computed in the backward pass, taken off the timeline (torch).

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


def build_plan(calls, config, batch_size: int = 1, static_bytes: int = 0, update_bytes: int = 0) -> list:
    """Decide every call of one forward pass: the policy's per-call rules, narrowed to ``device_budget``.

    One ``PlanEntry`` per call, in forward order. With ``config.device_budget`` only what the predicted step
    (``static_bytes`` of weights, gradients and optimizer state and the optimizer update's ``update_bytes``
    included) needs is offloaded.
    """
    decisions = policy.decide_all(calls, config, batch_size)
    if config.device_budget is not None:
        decisions = fit_budget(calls, decisions, config, batch_size, static_bytes, update_bytes)
    return _note_slabs(calls, policy.plan_entries(calls, decisions, batch_size, config.slab_bytes), batch_size)


def _note_slabs(calls, entries, batch_size: int) -> list:
    """Say in each entry's reason when the call is computed in slabs (TensorFlow, ``LMSConfig.slab_bytes``)."""
    import keras

    offloaded = [e for e in entries if e.offloaded]
    slab_bytes = min((e.slab_bytes for e in offloaded), default=0)  # one size per plan (fit_budget)
    plans = tf_step_memory.slab_plans(calls, [list(e.tensor_offloaded) for e in entries], batch_size, slab_bytes,
                                      keras.backend.backend())
    for i, plan in plans.items():
        entries[i].reason += f"; computed in {plan.count} slabs of {format_bytes(slab_bytes)} along axis 1"
    return entries


# The smallest slab the budget planner tries when the configured slab size does not fit device_budget.
MIN_SLAB_BYTES = 16 << 20


def fit_budget(calls, decisions, config, batch_size: int, static_bytes: int, update_bytes: int = 0):
    """Narrow ``decisions`` (from the min_bytes/keep_last/include/exclude policy) to fit ``device_budget``.

    Compares ``StepMemory.budget_bytes`` (the prediction with BUDGET_MARGIN on activations) with the budget.
    """
    budget = config.device_budget
    none = [[False] * len(d.offload_tensor) for d in decisions]
    plain = simulate(calls, none, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                     lean_normalization=config.lean_normalization, slab_bytes=config.slab_bytes)
    if plain.budget_bytes <= budget:
        log.info("keras-lms: LMS not needed: the step is predicted to need %s, within device_budget %s.",
                 format_bytes(plain.budget_bytes), format_bytes(budget))
        reason = (f"kept: LMS not needed, the step fits device_budget {format_bytes(budget)} "
                  f"(predicted {format_bytes(plain.budget_bytes)} with the planner's margin)")
        return [policy.CallDecision(list(row), reason) for row in none]
    sizes_in, _, _ = _tensors(calls, batch_size)
    n = len(calls)
    candidates = [i for i, d in enumerate(decisions) if d.offloaded]
    score = {i: sum(s for s, off in zip(sizes_in[i], decisions[i].offload_tensor) if off) * (n - i) for i in candidates}
    candidates.sort(key=lambda i: -score[i])
    chosen = [list(row) for row in none]
    memory = plain
    for i in candidates:
        chosen[i] = list(decisions[i].offload_tensor)
        memory = simulate(calls, chosen, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                          lean_normalization=config.lean_normalization, slab_bytes=config.slab_bytes)
        if memory.budget_bytes <= budget:
            break
    slab_bytes = config.slab_bytes
    while memory.budget_bytes > budget and slab_bytes // 2 >= MIN_SLAB_BYTES:
        # Everything offloaded and still too large: smaller slabs hold smaller working sets (TensorFlow).
        smaller = simulate(calls, chosen, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                           lean_normalization=config.lean_normalization, slab_bytes=slab_bytes // 2)
        if smaller.budget_bytes >= memory.budget_bytes:
            break
        slab_bytes, memory = slab_bytes // 2, smaller
    if memory.budget_bytes > budget:
        sizes_out = _tensors(calls, batch_size)[1]
        largest = max(range(n), key=lambda i: sum(sizes_in[i]) + sum(sizes_out[i]))
        need = sum(sizes_in[largest]) + sum(sizes_out[largest])
        raise BudgetError(
            f"device_budget {format_bytes(budget)} cannot be met: with every eligible tensor offloaded the step is "
            f"predicted to need {format_bytes(memory.budget_bytes)} with the planner's margin "
            f"({format_bytes(static_bytes)} of weights, gradients and optimizer state"
            + (f", {format_bytes(update_bytes)} of optimizer-update temporaries" if update_bytes else "")
            + f"). The largest single layer call is {calls[largest].unit.name!r} "
            f"({format_bytes(need)} for its inputs and outputs at batch size {batch_size}). Use a smaller batch "
            "or input, a larger budget, or lower min_bytes/keep_last."
        )
    log.info("keras-lms: offloading %d of %d layer calls to fit device_budget %s (predicted peak %s).",
             sum(any(r) for r in chosen), n, format_bytes(budget), format_bytes(memory.budget_bytes))
    if slab_bytes != config.slab_bytes:
        log.info("keras-lms: slabs of %s instead of slab_bytes=%s to fit device_budget %s.",
                 format_bytes(slab_bytes), format_bytes(config.slab_bytes), format_bytes(budget))
    out = []
    for i, d in enumerate(decisions):
        if any(chosen[i]):
            out.append(policy.CallDecision(chosen[i], d.reason + f" (needed for device_budget {format_bytes(budget)})",
                                           slab_bytes))
        elif d.offloaded:
            out.append(policy.CallDecision(chosen[i], f"kept: device_budget {format_bytes(budget)} is met without it"))
        else:
            out.append(d)
    return out


# Optimizers whose torch update keeps no weight-sized temporaries (measured: SGD with or without momentum).
_TORCH_LEAN_UPDATES = frozenset({"SGD"})
# Weight-sized temporaries of the other optimizers' torch updates, which run on all variables at once
# (torch._foreach_* ops): measured 3 for Adam, AdamW and RMSprop with benchmarks/torch_cpu_peak.py's tracker.
TORCH_UPDATE_TEMPORARIES = 3


def update_temporary_bytes(model, optimizer=None, backend: str | None = None) -> int:
    """Bytes of temporaries the optimizer update holds besides weights, gradients and optimizer state.

    On torch, Keras' optimizers update all variables at once with ``torch._foreach_*`` ops: Adam-like updates
    hold three trainable-weight-sized temporaries (a Dense chain's step peak is its Adam update). TensorFlow's
    executed graph updates variable by variable (no such term). Unknown optimizers on torch count as
    Adam-like; no optimizer (``None``) counts as Adam, Keras' usual choice.
    """
    import keras

    backend = backend or keras.backend.backend()
    if backend != "torch" or type(optimizer).__name__ in _TORCH_LEAN_UPDATES:
        return 0
    return TORCH_UPDATE_TEMPORARIES * variable_bytes(model.trainable_variables)


def variable_bytes(variables) -> int:
    """Bytes of ``variables`` (any iterable of Keras variables) in their storage dtype."""
    import numpy as np

    return sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype).replace("bfloat16", "float16")).itemsize
               for v in variables)


def static_bytes(model, optimizer=None, default_slots: int = 2) -> int:
    """Weights + gradients + optimizer state, in bytes (+ the layout copies below, on TensorFlow).

    Optimizer state is read from a built optimizer; otherwise ``default_slots`` copies of the trainable
    weights are assumed (Adam keeps two). On TensorFlow, grappler's layout optimizer (on a GPU) also keeps a
    channels-first copy of the optimizer slots of every 5-D (Conv3D-family) kernel from the start of the step
    to its update: seen on the executed graph as ``adam/Sub_*-TransposeNDHWCToNCDHW-LayoutOptimizer`` buffers
    that live the whole step (benchmarks/simulated_gpu_peak.py).
    """
    import keras

    weights = variable_bytes(model.variables)
    trainable = variable_bytes(model.trainable_variables)
    five_d = variable_bytes(v for v in model.trainable_variables if len(v.shape) == 5)
    if optimizer is not None and getattr(optimizer, "built", False):
        opt_state = variable_bytes(optimizer.variables)
        layout = variable_bytes(v for v in optimizer.variables if len(v.shape) == 5)
    else:
        opt_state = default_slots * trainable
        layout = default_slots * five_d
    if keras.backend.backend() != "tensorflow":
        layout = 0
    return weights + trainable + opt_state + layout
