"""What the TensorFlow back end adds to the planner's memory model: forward temporaries and slabs.

The planner (``keras_lms.planner.simulate``) counts the tensors a step keeps between layer calls. On TensorFlow,
calibrated against the grappler-optimised graph a GPU would execute (benchmarks/simulated_gpu_peak.py), two
more things decide the peak of large 3D models:

* **forward temporaries** of a call computed whole: grappler's layout optimiser runs float32 5-D convolutions
  channels-first on a GPU, so such a call holds a transposed copy of its input and of its output (and of the
  bias addition's output) besides the tensors themselves; BatchNormalization holds its centred input and
  normalised output in float32 (three input-sized float32 buffers under mixed precision, where the input is
  float16);
* **slabs** (``LMSConfig.slab_bytes``, keras_lms/offload/tf_slabs.py): an offloaded local call whose input is
  larger than a slab is computed a slab at a time. Its backward holds the output gradient, the input gradient
  being assembled and the slab working set (two windows and their temporaries) instead of the whole swapped-in
  input and whole temporaries; its swap-in is windows, not the whole tensor; a convolution over a channel
  concatenation reads the parts, so the concatenation is never built (nor its gradient).
"""

from __future__ import annotations

import keras

from keras_lms import layer_facts, policy

# Window-sized buffers a slab's recompute and gradient hold at once besides the pieces (the windows in flight and
# the slab's temporaries), in the compute dtype: BatchNorm under mixed precision works in float32 on float16
# windows. Calibrated on the 3D U-Net's --max-cube edges against benchmarks/simulated_gpu_peak.py (within +8%
# from 208^3 in float32 and from 304^3 in mixed_float16; docs/benchmarks.md).
SLAB_WORKING_WINDOWS = 2


def slab_plans(calls, offloaded, batch_size: int, slab_bytes: int, backend: str) -> dict:
    """Call index -> tf_slabs.SlabPlan for the offloaded calls the TensorFlow back end computes in slabs."""
    if backend != "tensorflow" or not slab_bytes:
        return {}
    from keras_lms.offload import tf_slabs

    plans = {}
    parts = concatenation_parts(calls, batch_size)
    for i, call in enumerate(calls):
        if not any(offloaded[i]) or any(s is None for shape in call.shapes for s in shape[1:]):
            continue
        shapes = [[batch_size if d is None else d for d in shape] for shape in call.shapes]
        sizes = [policy.tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        source = parts.get(call.keys[0]) if len(call.keys) == 1 else None
        if source is not None and not layer_facts.is_keras_class(call.unit, {"BatchNormalization"}):
            plan = tf_slabs.plan_slabs(call.unit, source[1], sum(source[2]), slab_bytes)
            if plan is not None:
                plans[i] = plan
                continue
        plan = tf_slabs.plan_slabs(call.unit, shapes, sum(sizes), slab_bytes)
        if plan is not None:
            plans[i] = plan
    return plans


def concatenation_parts(calls, batch_size: int) -> dict:
    """Output key of a last-axis Concatenate call -> (its index, its input shapes, its input sizes)."""
    out = {}
    for i, call in enumerate(calls):
        if type(call.unit) is not keras.layers.Concatenate or len(call.keys) < 2 or not call.output_keys:
            continue
        rank = len(call.output_shapes[0])
        if call.unit.axis % rank != rank - 1:
            continue
        shapes = [[batch_size if d is None else d for d in shape] for shape in call.shapes]
        sizes = [policy.tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        out[call.output_keys[0]] = (i, shapes, sizes)
    return out


def elided_concatenations(calls, plans: dict, batch_size: int) -> dict:
    """Index of a concatenation that is never built -> the slab call that reads its parts instead."""
    if not plans:
        return {}
    parts = concatenation_parts(calls, batch_size)
    elided = {}
    for i in plans:
        call = calls[i]
        if len(call.keys) == 1 and call.keys[0] in parts:
            elided[parts[call.keys[0]][0]] = i
    return elided


def _compute_ratio(dtype: str) -> float:
    """float32 bytes per input byte for BatchNormalization's float32 arithmetic on ``dtype`` inputs."""
    return 2.0 if dtype in ("float16", "bfloat16") else 1.0


def forward_temporaries(call, sizes_in, sizes_out, plan, backend: str) -> int:
    """Bytes a call holds only while its forward runs, besides its inputs and outputs (TensorFlow)."""
    if backend != "tensorflow":
        return 0
    unit = call.unit
    if plan is not None:  # slab forward: the pieces of the output, then their concatenation
        if plan.moments or layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS):  # tf_slabs.computes_in_...
            window = sum(sizes_in) / plan.count
            return int(sum(sizes_out) + SLAB_WORKING_WINDOWS * window * _compute_ratio(call.dtypes[0]))
        return 0
    if layer_facts.is_keras_class(unit, {"BatchNormalization"}):
        ratio = _compute_ratio(call.dtypes[0])
        return int(sum(sizes_in) * ratio * (3 if ratio > 1 else 1))
    five_d = call.shapes and len(call.shapes[0]) == 5
    if five_d and layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS) and call.dtypes[0] == "float32":
        bias = 1 if getattr(unit, "use_bias", False) and "Transpose" in type(unit).__name__ else 0
        return sum(sizes_in) + sum(sizes_out) * (1 + bias)
    return 0


def slab_backward_bytes(call, sizes_in, sizes_out, plan) -> int:
    """Bytes a slab-computed call's backward holds: the output gradient, the input gradient being assembled
    (pieces, then their concatenation, one part at a time) and the slab working set."""
    window = sum(sizes_in) / plan.count
    working = SLAB_WORKING_WINDOWS * window * _compute_ratio(call.dtypes[0])
    return int(sum(sizes_in) + max(sum(sizes_out), max(sizes_in, default=0)) + working)


def normalization_float32_bytes(call, sizes_in, backend: str) -> int:
    """The float32 share of a whole (not slab-computed) BatchNormalization backward's temporaries beyond what
    ``layer_facts.NORMALIZATION_TEMPORARIES`` input-sized buffers count: under mixed precision Keras computes
    BatchNorm in float32, so each of those temporaries is twice the float16 input."""
    if backend != "tensorflow" or not layer_facts.is_keras_class(call.unit, {"BatchNormalization"}):
        return 0
    return int(sum(sizes_in) * layer_facts.NORMALIZATION_TEMPORARIES * (_compute_ratio(call.dtypes[0]) - 1))
