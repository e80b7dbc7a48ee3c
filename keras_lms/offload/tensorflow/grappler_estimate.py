"""Where keeping tensors on the device makes grappler swap by itself: a bound from its estimate's shape.

On a GPU, grappler's memory optimizer estimates the step's peak from the graph it optimises and inserts swaps of
its own (``_CopyFromGpuToHost`` / ``_CopyFromHostToGpu`` pairs) where the estimate exceeds the device's memory. At
the volumes users come for its estimate peaks at the top of the backward, where it counts about four tensors of
the largest size at once (the last activation's output and gradient, the head's input gradient and that
gradient's slab pieces or layout fence: docs/design.md, "A budget the starts refuse"), about 2.5 GiB over the
executed peak at 400^3 float32 and 496^3 mixed_float16, and every call kept on the device is live there too.
Measured with ``benchmarks/simulated_gpu_peak.py --like-for-like`` on 16 GiB plans: with the keep search, 400^3
float32 and 496^3 mixed_float16 (four largest tensors 15.3 and 14.6 GiB) made grappler estimate 16.8-17.8 GiB and
swap 28-56 GiB each way; 384^3 float32 and 448^3 mixed_float16 (13.5 and 10.7 GiB) kept calls and it swapped
nothing. So the keep search ran only where four of the largest tensors fit the budget with the planner's margin.

Since the wrapped step is called without grappler's swaps (``call_options``, session 31) that bound applies only
where they still run: with the control ``call_options.KEEP_GRAPPLER_SWAPS_OUT = False``. With the swaps kept out
the keep search runs at every edge, and the executed graph on a virtual GPU of the budget's size checks the plans
it makes there (docs/benchmarks.md, "Keeps at the edge").
"""

from __future__ import annotations

from keras_lms.offload.tensorflow import call_options
from keras_lms.planning import layer_facts
from keras_lms.planning.memory_model import BUDGET_MARGIN, tensor_sizes

# Tensors of the largest size that grappler's estimate counts at once at the top of the backward.
TOP_OF_BACKWARD_TENSORS = 4


def room_for_keeps(calls, batch_size: int, device_budget) -> bool:
    """Whether calls kept on the device leave grappler's estimate below ``device_budget`` (module docstring)."""
    if device_budget is None or not calls or not call_options.swaps_in_wrapped_step():
        return True
    _, sizes_out, _ = tensor_sizes(calls, batch_size)
    # (a channel concatenation read in slabs is never built: its parts are the tensors)
    largest = max((size for call, sizes in zip(calls, sizes_out) for size in sizes
                   if not layer_facts.is_keras_class(call.unit, {"Concatenate"})), default=0)
    return TOP_OF_BACKWARD_TENSORS * largest * BUDGET_MARGIN <= device_budget
