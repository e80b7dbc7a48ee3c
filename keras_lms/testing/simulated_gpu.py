"""Device-memory peak of a Keras training step as TensorFlow would execute it on a GPU, without a GPU.

The graph a ``tf.function`` builds is not the graph TensorFlow runs: grappler rewrites it first (it may,
for example, bypass an ``Identity`` placed on the host), and cross-device edges become ``_Send``/``_Recv``
transfers. A check of the traced graph cannot see either, so ``simulate`` asks TensorFlow itself:

1. ``configure_logical_cpus()`` (keras_lms/testing/logical_devices.py; before TensorFlow initialises) splits
   the CPU into ``/CPU:0`` (the host) and ``/CPU:1`` (a stand-in for the GPU).
2. ``trace_training_step`` (keras_lms/testing/traced_step.py) builds one training step under
   ``tf.device("/CPU:1")`` and maps its GraphDef onto a virtual machine: the stand-in becomes ``GPU:0``, the
   host stays the host CPU, and every variable's shape is made known to shape inference
   (``MemoryPeak.unknown_shape_tensors`` counts GPU tensors whose shape was still not inferred).
3. ``optimize`` (keras_lms/testing/virtual_cluster.py) runs grappler's default pipeline (the one every
   ``tf.function`` gets; a default ``RewriterConfig``) against a grappler ``VirtualCluster`` made of that GPU
   and the host CPU. Because the cluster has a GPU, the layout optimiser converts convolutions to NCHW as it
   would on a real one.
4. ``schedule`` (same module) runs TensorFlow's virtual scheduler on the optimised graph
   (``Cluster.MeasureCosts`` with a timeline). Each device runs one op at a time, in the order ops become ready
   (inputs and control inputs, across devices too), with analytical op costs. Every data edge between devices
   becomes a ``_Send`` (on a "Channel" device) and a ``_Recv`` on the receiving device; the ``_Recv``'s only
   input is the ``_Send``, so it runs as soon as the sending side has produced the tensor, whatever the
   receiving side is doing. That is exactly TensorFlow's behaviour, and why a copy back to the GPU must be held
   back on the host.
5. ``peak_memory`` (keras_lms/testing/timeline_peak.py) replays that timeline: how long each buffer lives on
   each device, and the most bytes live at once on the GPU.

``simulate(..., gpu_memory_bytes=M)`` runs step 3 as on a GPU of M bytes: grappler's memory optimizer then
swaps by itself when its estimate of the graph exceeds M, as it does on a real device, with the options the step
runs with (a wrapped model's train function keeps grappler's swaps out: ``step_memory_optimization``) (issue 28;
keras_lms/testing/grappler_swaps.py registers its swap ops so that the passes after it run as on a GPU build).
Step 4 still runs on a 1 TiB cluster, and step 5 counts each swap's host copy on the host and its copy back on
the GPU from grappler's trigger on. Grappler's choice of swaps is not deterministic (it walks containers keyed
by pointers), so a size near the limit may fit in some runs and not in others: simulate it several times.
``Simulation.grappler_estimate_bytes`` is the estimate that decides it (``grappler_estimate=True``).

The peak reported is ``static_bytes`` (model and optimizer variables, resident on the GPU) plus the
timeline's peak. Not modelled: allocator rounding and fragmentation, cuDNN workspaces, the host link's
bandwidth (a transfer takes (almost) no time; it changes when a copy completes, not when its buffer is allocated), and
GPU-only grappler rewrites that a CPU-only TensorFlow build does not perform (the remapper's Conv+BiasAdd+Relu
fusions).
"""

from __future__ import annotations

import dataclasses
import time

from keras_lms.testing.conv_flops import convolution_flops
from keras_lms.testing.grappler_swaps import register_swap_ops, swap_pairs
from keras_lms.testing.timeline_peak import MemoryPeak, buffers, peak_memory
from keras_lms.testing.traced_step import trace_training_step
from keras_lms.testing.virtual_cluster import GPU, grappler_memory_estimate, optimize, schedule, virtual_cluster

SWAP_MARKERS = ("lms_swap_out", "lms_swap_in")


@dataclasses.dataclass
class Simulation:
    """Simulated device memory of one training step on the virtual GPU."""

    peak_bytes: int  # static_bytes + timeline peak
    static_bytes: int  # model + optimizer variables
    gpu: MemoryPeak
    graph_memory_peak_bytes: int  # grappler's own DeterminePeakMemoryUsage on the GPU (diagnostic; -1: not run)
    swap_nodes_traced: dict  # marker (lms_swap_out, lms_swap_in) -> nodes so named before grappler
    swap_nodes_optimized: dict  # ... and after grappler
    nodes_traced: int
    nodes_optimized: int
    seconds: float
    conv_flops: float = 0.0  # convolution FLOPs the GPU computes in the optimised graph (conv_flops.py)
    conv_ops: int = 0  # convolution ops counted ...
    conv_ops_unknown: int = 0  # ... and those whose shapes grappler could not infer (not counted)
    gpu_memory_bytes: int = 0  # the GPU memory size grappler optimised for (0: 1 TiB, it never swaps)
    grappler_swaps: list = dataclasses.field(default_factory=list)  # grappler_swaps.SwapPair it inserted
    grappler_swap_bytes: int = 0  # bytes those swaps copy to host (and back) per step
    grappler_estimate_bytes: int = -1  # grappler's estimate when its memory pass decides (-1: not asked)
    before_memory_pass: object = None  # the GraphDef that estimate is of (grappler_estimate=True only)
    fetch: list = dataclasses.field(default_factory=list)  # the step's fetch nodes (for grappler_item)
    optimized: object = None  # the GraphDef grappler optimised for the virtual GPU (what the timeline ran)


def count_named(graph_def, markers=SWAP_MARKERS) -> dict:
    """marker -> number of nodes whose name contains it (the keras-lms swap ops)."""
    return {m: sum(m in node.name for node in graph_def.node) for m in markers}


def simulate(model, x_shape, y_shape, dtype="float32", optimizer="adam", graph_memory: bool = True,
             gpu_memory_bytes: int | None = None, grappler_estimate: bool = False) -> Simulation:
    """Trace, optimise and schedule one training step of ``model``; see the module docstring.

    ``gpu_memory_bytes``: optimise for a GPU of that size, so that grappler swaps as on the real device
    (default: 1 TiB, no swaps of grappler's). ``grappler_estimate``: also compute the estimate grappler's memory
    pass compares with it (one more optimisation of the step).
    """
    start = time.perf_counter()
    traced = trace_training_step(model, x_shape, y_shape, dtype, optimizer)
    if gpu_memory_bytes is not None:
        register_swap_ops()
    cluster = virtual_cluster()
    try:
        if gpu_memory_bytes is None:
            optimized = optimize(traced.graph_def, traced.fetch, cluster)
        else:
            sized = virtual_cluster(timeline=False, gpu_memory_bytes=gpu_memory_bytes)
            try:
                optimized = optimize(traced.graph_def, traced.fetch, sized,
                                     memory_optimization=step_memory_optimization(model))
            finally:
                sized.Shutdown()
        estimate, before_memory_pass = -1, None
        if grappler_estimate:
            before_memory_pass = optimize(traced.graph_def, traced.fetch, cluster, until_memory_pass=True)
            estimate = grappler_memory_estimate(before_memory_pass, traced.fetch)
        step_stats, item = schedule(optimized, traced.fetch, cluster)
        gpu = peak_memory(optimized, step_stats, GPU, traced.fetch)
        conv = convolution_flops(optimized, item, GPU, traced.convolution_shapes)
        grappler_peak = -1
        if graph_memory:
            grappler_peak = int(cluster.DeterminePeakMemoryUsage(item).get(GPU, (-1, []))[0])
    finally:
        cluster.Shutdown()
    swaps = swap_pairs(optimized)
    return Simulation(traced.static_bytes + gpu.peak_bytes, traced.static_bytes, gpu, grappler_peak,
                      count_named(traced.graph_def), count_named(optimized), len(traced.graph_def.node),
                      len(optimized.node), time.perf_counter() - start, *conv,
                      gpu_memory_bytes=gpu_memory_bytes or 0, grappler_swaps=swaps,
                      grappler_swap_bytes=gpu.grappler_swap_bytes, grappler_estimate_bytes=estimate,
                      before_memory_pass=before_memory_pass, fetch=traced.fetch, optimized=optimized)


def step_memory_optimization(model) -> int | None:
    """The memory optimizer's setting ``model``'s training step runs at: a wrapped model's train function runs
    without grappler's swaps (``call_options.without_grappler_swaps``; ``KEEP_GRAPPLER_SWAPS_OUT = False``: with
    them), a plain model at TensorFlow's default (None)."""
    from keras_lms.model import LMSModel
    from keras_lms.offload.tensorflow import call_options

    if isinstance(model, LMSModel):
        return call_options.wrapped_step_setting(call_options.RewriterConfig.DEFAULT_MEM_OPT)
    return None


def executed_buffers(model, x_shape, y_shape, dtype="float32", optimizer="adam") -> list:
    """The compute device's buffers (``timeline_peak.buffers``: name, size, start and end) of one training step of
    ``model`` as grappler optimises it for the virtual GPU and its scheduler replays it: for tests that look at what
    is live during some ops (a pass, a call), not only at the step's peak."""
    traced = trace_training_step(model, x_shape, y_shape, dtype, optimizer)
    cluster = virtual_cluster()
    try:
        optimized = optimize(traced.graph_def, traced.fetch, cluster)
        step_stats, _ = schedule(optimized, traced.fetch, cluster)
    finally:
        cluster.Shutdown()
    return [b for b in buffers(optimized, step_stats, traced.fetch) if b.device == GPU and b.size > 0]
