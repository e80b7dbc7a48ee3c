"""What one layer call costs to compute: FLOPs of its kernels and bytes its memory-bound work reads and writes.

From shapes alone (the planning trace), for the step-time model (``step_time``). Kernel layers (convolutions,
transposed convolutions, depthwise and separable convolutions, Dense/EinsumDense) are counted in FLOPs, 2 per
multiply-add, with the usual backward of twice the forward (the input gradient and the weight gradient are each
one forward's worth of multiply-adds). Everything else is memory-bound and counted in bytes: what it reads and
writes once per pass (normalisation reads its input twice, for the statistics and to normalise). That is the
roofline a GPU runs such layers at; the device profile turns both into seconds.
"""

from __future__ import annotations

import dataclasses
import math

from keras_lms.planning import layer_facts
from keras_lms.planning.plan import tensor_bytes


@dataclasses.dataclass(frozen=True)
class CallCost:
    """One call's work: kernel FLOPs (forward; backward = input and weight gradients) and memory-bound bytes.

    Attributes:
        forward_flops / input_gradient_flops / weight_gradient_flops: multiply-adds x 2 of the kernels.
        forward_bytes / backward_bytes: bytes memory-bound work reads plus writes (0 for kernels, whose
            bytes hide under their FLOPs, unless the back end counts a bias, a fused activation or its eager
            kernels: ``BackendFacts.eager_bytes``).
        forward_layout_bytes / backward_layout_bytes: bytes of strided layout copies around the call (Keras on
            torch copies a channels-last convolution's input to channels-first and back), which run at the
            profile's ``layout_copy_bytes_per_second``.
        dtype: the dtype the kernels compute in (the layer's compute dtype: float16 under mixed_float16).
        channels: a convolution's larger channel count (input or output), which its achieved rate depends on
            (``DeviceProfile.flops_rate``); 0 for other calls.
    """

    forward_flops: float = 0.0
    input_gradient_flops: float = 0.0
    weight_gradient_flops: float = 0.0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    dtype: str = "float32"
    channels: int = 0
    forward_layout_bytes: float = 0.0
    backward_layout_bytes: float = 0.0

    @property
    def backward_flops(self) -> float:
        return self.input_gradient_flops + self.weight_gradient_flops


def _dims(shape, batch_size: int) -> list:
    return [batch_size if (d is None and i == 0) else (1 if d is None else int(d)) for i, d in enumerate(shape)]


def _positions(shape, batch_size: int) -> int:
    """Batch x spatial positions of a channels-last tensor (every axis but the last)."""
    return math.prod(_dims(shape, batch_size)[:-1])


def _compute_dtype(unit, call) -> str:
    dtype = getattr(unit, "compute_dtype", None) or (str(call.dtypes[0]) if call.dtypes else "float32")
    return str(getattr(dtype, "name", dtype))


def kernel_flops(unit, call, batch_size: int = 1) -> float:
    """Forward multiply-adds x 2 of a kernel layer's call; 0 for layers that are not kernel layers."""
    if not call.shapes or not call.output_shapes:
        return 0.0
    cls = type(unit).__name__
    x, y = call.shapes[0], call.output_shapes[0]
    if not layer_facts.is_keras_class(unit, layer_facts.KERNEL_LAYERS):
        return 0.0
    channels_last = getattr(unit, "data_format", "channels_last") != "channels_first"
    if not channels_last:  # count positions as all axes but the channel axis (axis 1)
        x = [x[0], *x[2:], x[1]]
        y = [y[0], *y[2:], y[1]]
    c_in, c_out = _dims(x, batch_size)[-1], _dims(y, batch_size)[-1]
    if cls in ("Dense", "EinsumDense"):
        kernel = getattr(unit, "kernel", None)
        weights = math.prod(kernel.shape) if kernel is not None else c_in * c_out
        return 2.0 * _positions(x, batch_size) * weights
    window = math.prod(getattr(unit, "kernel_size", (1,)))
    if "Transpose" in cls:  # every input position scatters into a window of every output channel
        return 2.0 * _positions(x, batch_size) * window * c_in * c_out
    if cls.startswith("Depthwise"):
        return 2.0 * _positions(y, batch_size) * window * c_out
    if cls.startswith("Separable"):
        multiplier = getattr(unit, "depth_multiplier", 1)
        return 2.0 * _positions(y, batch_size) * (window * c_in * multiplier + c_in * multiplier * c_out)
    groups = getattr(unit, "groups", 1) or 1
    return 2.0 * _positions(y, batch_size) * window * (c_in // groups) * c_out


def convolution_channels(unit, call) -> int:
    """The larger of a convolution's input and output channel counts; 0 for other calls."""
    if not layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS) or not call.shapes or not call.output_shapes:
        return 0
    axis = 1 if getattr(unit, "data_format", "channels_last") == "channels_first" else -1
    return int(max(call.shapes[0][axis] or 1, call.output_shapes[0][axis] or 1))


def call_cost(call, batch_size: int = 1, facts=None) -> CallCost:
    """The cost of one traced call (``planning.RawCall``) at ``batch_size``; with ``facts`` (the back end's
    ``BackendFacts``), memory-bound bytes as that framework's eager kernels move them where it counts them.
    Kept on the call (``RawCall.derived``): the planner's searches predict hundreds of steps of the same calls."""
    derived = getattr(call, "derived", None)
    if derived is None:
        return _call_cost(call, batch_size, facts)
    key = ("call_cost", batch_size, id(facts))
    known = derived.get(key)
    if known is None or known[0] is not facts:
        known = derived[key] = (facts, _call_cost(call, batch_size, facts))
    return known[1]


def _call_cost(call, batch_size: int, facts) -> CallCost:
    unit = call.unit
    dtype = _compute_dtype(unit, call)
    flops = kernel_flops(unit, call, batch_size)
    size_in = sum(tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes))
    size_out = sum(tensor_bytes(s, d, batch_size) for s, d in zip(call.output_shapes, call.output_dtypes))
    eager = facts.eager_bytes(call, size_in, size_out) if facts is not None else None
    if flops:
        # the first call of a model needs no input gradient, but frameworks compute it unless the input is
        # not differentiable; keep the usual 2x for the backward
        cost = CallCost(flops, flops, flops, 0.0, 0.0, dtype, convolution_channels(unit, call))
        return dataclasses.replace(cost, **eager._asdict()) if eager is not None else cost
    if eager is not None:
        return CallCost(dtype=dtype, **eager._asdict())
    if layer_facts.is_keras_class(unit, layer_facts.NORMALIZATION_LAYERS):
        # statistics pass + normalise pass over the input, then the output; the backward reads x and dy twice
        # (the reductions, then the input gradient) and writes dx
        return CallCost(forward_bytes=2 * size_in + size_out, backward_bytes=2 * (size_in + size_out) + size_in,
                        dtype=dtype)
    if layer_facts.is_keras_class(unit, layer_facts.STRUCTURAL_LAYERS):
        # copies (concatenation, padding) or pure metadata (reshape); the gradient slices or sums the same bytes
        moves = 0 if type(unit).__name__ in ("Reshape", "Flatten", "Identity") else size_in + size_out
        return CallCost(forward_bytes=moves, backward_bytes=moves, dtype=dtype)
    # element-wise activations, Dropout, pooling, other layers: read the input, write the output; the backward
    # reads the upstream gradient and one saved tensor and writes the input gradient
    return CallCost(forward_bytes=size_in + size_out, backward_bytes=size_out + 2 * size_in, dtype=dtype)
