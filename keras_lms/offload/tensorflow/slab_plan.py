"""Where a slab-computed call is cut: the slab plan of one layer call, from shapes alone (no TensorFlow).

The TensorFlow back end computes an offloaded local call slab by slab (``slabs``); the planner's memory model
needs the same cuts before anything runs (``step_memory.TensorFlowFacts.slab_plans``), so they are decided
here, once, for both.
"""

from __future__ import annotations

import dataclasses
import math

import keras

from keras_lms.planning import layer_facts

AXIS = 1  # the first spatial axis of a channels-last tensor (batch, spatial..., channels)


EXACT_ROWS = True  # False: every convolution slab computes its halo rows too (the comparisons' control)


@dataclasses.dataclass(frozen=True)
class SlabPlan:
    """How one call is cut: ``bounds`` ((s0, s1) per slab) of ``length`` rows along AXIS, the layer's halo,
    and whether it is a BatchNormalization with batch statistics (``moments``).

    ``exact_rows``: a convolution computed as exactly its slab's rows (``slab_rows``): its forward convolves
    "valid" along AXIS over the window's ``s1 - s0 + 2h`` rows, its backward reads the same window (not one
    twice as wide), convolves exactly ``s1 - s0`` rows for the weight gradient and the window's rows for the
    input gradient. Otherwise a slab convolves its whole window "same" and crops: ``2h`` extra rows forward and
    ``4h`` for each gradient, 23% more convolution FLOPs in 14-row slabs of a 3x3x3 convolution.
    """

    length: int
    bounds: tuple
    halo: int
    moments: bool
    stride: int = 1  # input rows per output row (a tiling max pooling); bounds are multiples of it
    exact_rows: bool = False

    @property
    def count(self) -> int:
        return len(self.bounds)

    def forward_window(self, s0, s1):
        return max(0, s0 - self.halo), min(self.length, s1 + self.halo)

    def backward_window(self, s0, s1):
        if self.exact_rows:
            return self.forward_window(s0, s1)
        return max(0, s0 - 2 * self.halo), min(self.length, s1 + 2 * self.halo)

    def gradient_rows(self, s0, s1):
        return max(0, s0 - self.halo), min(self.length, s1 + self.halo)


def slab_bounds(length: int, count: int, align: int = 1) -> tuple:
    """``count`` contiguous, nearly equal row ranges covering [0, length), inner edges multiples of ``align``."""
    edges = [round(i * length / count / align) * align for i in range(count)] + [length]
    return tuple((a, b) for a, b in zip(edges, edges[1:]) if b > a)


def plan_slabs(unit, shapes, nbytes: int, slab_bytes: int, output_bytes: int = 0) -> SlabPlan | None:
    """The slab plan of a call of ``unit`` on inputs of ``shapes`` (``nbytes`` in all), or None for whole.

    Slabs are used when ``slab_bytes`` > 0, the inputs are larger than it, every input is a channels-last
    tensor of rank >= 3 with the same static length along AXIS, and the layer is local (``slab_halo``).
    A convolution is also cut when its output (``output_bytes``) is larger than ``slab_bytes``, and into as
    many slabs as the larger side needs: a first convolution that widens a one-channel volume to 16 channels
    has a small input and a large output, and computed in slabs its output can be recomputed window by window
    from that small input's host copy (``recompute_candidates``) instead of being copied 16 times larger.
    """
    if output_bytes and computes_in_slabs_forward(unit):
        nbytes = max(nbytes, output_bytes)
    if not slab_bytes or nbytes <= slab_bytes or not shapes:
        return None
    ranks = {len(s) for s in shapes}
    lengths = {s[AXIS] if len(s) > AXIS else None for s in shapes}
    if len(ranks) != 1 or len(lengths) != 1 or None in lengths:
        return None
    rank, length = ranks.pop(), lengths.pop()
    halo = layer_facts.slab_halo(unit, rank)
    if halo is None or getattr(unit, "activity_regularizer", None) is not None:
        return None
    stride = layer_facts.slab_stride(unit)
    if length % stride:
        return None
    count = min(length // stride, math.ceil(nbytes / slab_bytes))
    if count < 2:
        return None
    moments = isinstance(unit, keras.layers.BatchNormalization)
    exact = EXACT_ROWS and halo > 0 and computes_exact_rows(unit)
    return SlabPlan(length, slab_bounds(length, count, stride), halo, moments, stride, exact)


def computes_exact_rows(unit) -> bool:
    """Whether a slab-computed call of ``unit`` can convolve exactly its slab's rows (``slab_rows``): Keras'
    own ``Conv1D/2D/3D`` call, ``"same"``, stride and dilation 1, odd kernels on every axis (symmetric padding),
    one group and a linear activation (the input gradient is then the transposed convolution of the output
    gradient, and needs no input rows; a fused non-linear activation would need its output's)."""
    if not (layer_facts.is_keras_class(unit, {"Conv1D", "Conv2D", "Conv3D"})
            and layer_facts.runs_keras_kernel_call(unit)):
        return False
    return (unit.padding == "same" and unit.data_format == "channels_last" and getattr(unit, "groups", 1) == 1
            and all(s == 1 for s in unit.strides) and all(d == 1 for d in unit.dilation_rate)
            and all(k % 2 == 1 for k in unit.kernel_size) and not getattr(unit, "lora_enabled", False)
            and layer_facts.activation_name(unit.activation) == "linear")


def computes_in_slabs_forward(unit) -> bool:
    """Whether a slab-planned call of ``unit`` also runs its forward in slabs: convolutions (grappler's layout
    optimiser holds channels-first copies of their whole input and output on a GPU) and, always, calls with
    BatchNorm statistics or concatenated inputs. Element-wise layers and pooling run whole (no temporaries)."""
    return layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS)
