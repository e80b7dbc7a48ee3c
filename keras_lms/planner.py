"""The budget planner: predict a training step's device memory and offload only what the budget needs.

The memory model is static and simple on purpose, so users can reason about it (and ``keras-lms report``
shows it): a step is 2n positions (n layer calls forward, then their backward in reverse). A tensor occupies
the device from its producer's call until its last use: its last forward consumer, or — if a consumer keeps
it for the backward pass (not offloaded) — that consumer's backward. An offloaded input is brought back for
its consumer's backward (``prefetch`` calls early). Each backward position also holds the gradients of the
call's inputs and outputs and one input-sized temporary. Structural layers (Add, Concatenate, reshapes) keep
nothing for their backward; relu-like activation layers keep their output. Static memory (weights,
gradients, optimizer state) is added on top. ``benchmarks/report_accuracy.py`` compares the prediction with
measured allocator peaks (docs/benchmarks.md).

Choice: largest and longest-lived tensors first (bytes x distance to their backward use), the last layers
stay resident (``keep_last``), until the predicted peak fits; nothing is offloaded when the step fits
anyway; when even full offload cannot fit, the error names the largest single layer call.
"""

from __future__ import annotations

import dataclasses
import logging

from keras_lms.config import format_bytes

log = logging.getLogger("keras_lms")

# The tensor-level model misses allocator rounding and framework temporaries: measured peaks were 9-12% above
# it (benchmarks/report_accuracy.py). Predictions add this margin so the planner errs on the safe side.
ACTIVATION_OVERHEAD = 1.15


@dataclasses.dataclass
class StepMemory:
    """Predicted device memory of one training step (bytes)."""

    static_bytes: int
    timeline: list  # device activation bytes at each of the 2n positions (forward, then backward)

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.timeline, default=0)

    @property
    def peak_bytes(self) -> int:
        """Static bytes plus the activation peak with the allocator margin (ACTIVATION_OVERHEAD)."""
        return self.static_bytes + int(self.activation_peak_bytes * ACTIVATION_OVERHEAD)


class BudgetError(ValueError):
    """The step cannot fit the device budget even with every eligible tensor offloaded."""


_NO_INPUT_GRAD_LAYERS = (
    "Add", "Subtract", "Concatenate", "Average", "Flatten", "Reshape", "Permute", "RepeatVector", "Identity",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
    "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
)
_OUTPUT_GRAD_ACTIVATIONS = ("relu", "sigmoid", "tanh", "elu")


def backward_reads(unit) -> tuple:
    """``(reads_inputs, reads_output)`` of the unit's gradient: what its backward pass must keep.

    Structural layers (Add, Concatenate, reshapes, padding, average pooling) need no tensor values for their
    gradient; relu/sigmoid/tanh/elu activation layers need their output, not their input. Everything else is
    assumed to need its inputs (the conservative choice).
    """
    import keras

    name = type(unit).__name__
    if name in _NO_INPUT_GRAD_LAYERS and type(unit).__module__.startswith("keras."):
        return False, False
    if type(unit) is keras.layers.Activation and getattr(unit.activation, "__name__", "") in _OUTPUT_GRAD_ACTIVATIONS:
        return False, True
    if type(unit) is keras.layers.ReLU and not unit.max_value and not unit.negative_slope and not unit.threshold:
        return False, True
    if type(unit) is keras.layers.Activation and getattr(unit.activation, "__name__", "") == "linear":
        return False, False
    return True, False


def _tensors(calls, batch_size):
    from keras_lms.policy import tensor_bytes

    sizes_in, sizes_out, keys_out = [], [], []
    for i, call in enumerate(calls):
        sizes_in.append([tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)])
        sizes_out.append([tensor_bytes(s, d, batch_size) for s, d in zip(call.output_shapes, call.output_dtypes)])
        keys = list(call.output_keys) or [("out", i, j) for j in range(len(call.output_shapes))]
        keys_out.append(keys)
    return sizes_in, sizes_out, keys_out


def simulate(calls, offloaded, batch_size: int = 1, prefetch: int = 1, static_bytes: int = 0) -> StepMemory:
    """Device memory timeline for a plan; ``offloaded[i][j]`` says whether input j of call i goes to host."""
    n = len(calls)
    positions = 2 * n
    if n == 0:
        return StepMemory(static_bytes, [])
    sizes_in, sizes_out, keys_out = _tensors(calls, batch_size)
    info = {}  # key -> [size, first position on the device, last position (None: not consumed by a call)]
    for i, (keys, sizes) in enumerate(zip(keys_out, sizes_out)):
        for key, size in zip(keys, sizes):
            info[key] = [size, i, None]
    delta = [0] * (positions + 1)
    for i, call in enumerate(calls):
        backward = positions - 1 - i
        reads_inputs, reads_output = backward_reads(call.unit)
        if reads_output and not any(offloaded[i]):  # a plain activation keeps its output for its backward
            for key in keys_out[i]:
                info[key][2] = max(info[key][2] or 0, backward)
        for key, size, off in zip(call.keys, sizes_in[i], offloaded[i]):
            entry = info.setdefault(key, [size, 0, None])  # a model input exists from the start
            last_use = backward if (reads_inputs and not off) else i  # else freed after its forward use
            entry[2] = last_use if entry[2] is None else max(entry[2], last_use)
            if off and reads_inputs:  # swapped in for this call's backward, prefetch calls early
                start = positions - 1 - min(i + prefetch, n - 1)
                delta[start] += size
                delta[backward + 1] -= size
        # while its backward runs: the gradients of its outputs and inputs, and one input-sized temporary
        # (convolution and BatchNorm gradients allocate one)
        grads = 2 * sum(sizes_in[i]) + sum(sizes_out[i])
        delta[backward] += grads
        delta[backward + 1] -= grads
    for size, start, end in info.values():
        end = n if end is None else end  # model outputs live until the loss's backward starts
        delta[start] += size
        delta[end + 1] -= size
    timeline, running = [], 0
    for pos in range(positions):
        running += delta[pos]
        timeline.append(running)
    return StepMemory(static_bytes, timeline)


def fit_budget(calls, decisions, config, batch_size: int, static_bytes: int):
    """Narrow ``decisions`` (from the min_bytes/keep_last/include/exclude policy) to fit ``device_budget``."""
    from keras_lms.policy import CallDecision

    budget = config.device_budget
    none = [[False] * len(d.offload_tensor) for d in decisions]
    plain = simulate(calls, none, batch_size, config.prefetch, static_bytes)
    if plain.peak_bytes <= budget:
        log.info("keras-lms: LMS not needed: the step is predicted to need %s, within device_budget %s.",
                 format_bytes(plain.peak_bytes), format_bytes(budget))
        reason = (f"kept: LMS not needed, the step fits device_budget {format_bytes(budget)} "
                  f"(predicted {format_bytes(plain.peak_bytes)})")
        return [CallDecision(list(row), reason) for row in none]
    sizes_in, _, _ = _tensors(calls, batch_size)
    n = len(calls)
    candidates = [i for i, d in enumerate(decisions) if d.offloaded]
    score = {i: sum(s for s, off in zip(sizes_in[i], decisions[i].offload_tensor) if off) * (n - i) for i in candidates}
    candidates.sort(key=lambda i: -score[i])
    chosen = [list(row) for row in none]
    memory = plain
    for i in candidates:
        chosen[i] = list(decisions[i].offload_tensor)
        memory = simulate(calls, chosen, batch_size, config.prefetch, static_bytes)
        if memory.peak_bytes <= budget:
            break
    if memory.peak_bytes > budget:
        sizes_out = _tensors(calls, batch_size)[1]
        largest = max(range(n), key=lambda i: sum(sizes_in[i]) + sum(sizes_out[i]))
        need = sum(sizes_in[largest]) + sum(sizes_out[largest])
        raise BudgetError(
            f"device_budget {format_bytes(budget)} cannot be met: with every eligible tensor offloaded the step is "
            f"predicted to need {format_bytes(memory.peak_bytes)} ({format_bytes(static_bytes)} of weights, "
            f"gradients and optimizer state). The largest single layer call is {calls[largest].unit.name!r} "
            f"({format_bytes(need)} for its inputs and outputs at batch size {batch_size}). Use a smaller batch "
            "or input, a larger budget, or lower min_bytes/keep_last."
        )
    log.info("keras-lms: offloading %d of %d layer calls to fit device_budget %s (predicted peak %s).",
             sum(any(r) for r in chosen), n, format_bytes(budget), format_bytes(memory.peak_bytes))
    out = []
    for i, d in enumerate(decisions):
        if any(chosen[i]):
            out.append(CallDecision(chosen[i], d.reason + f" (needed for device_budget {format_bytes(budget)})"))
        elif d.offloaded:
            out.append(CallDecision(chosen[i], f"kept: device_budget {format_bytes(budget)} is met without it"))
        else:
            out.append(d)
    return out


def static_bytes(model, optimizer=None, default_slots: int = 2) -> int:
    """Weights + gradients + optimizer state, in bytes.

    Optimizer state is read from a built optimizer; otherwise ``default_slots`` copies of the trainable
    weights are assumed (Adam keeps two).
    """
    import numpy as np

    def nbytes(v):
        return int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype).replace("bfloat16", "float16")).itemsize

    weights = sum(nbytes(v) for v in model.variables)
    trainable = sum(nbytes(v) for v in model.trainable_variables)
    if optimizer is not None and getattr(optimizer, "built", False):
        opt_state = sum(nbytes(v) for v in optimizer.variables)
    else:
        opt_state = default_slots * trainable
    return weights + trainable + opt_state
