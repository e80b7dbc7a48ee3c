"""Device-memory peak of a Keras training step as TensorFlow would execute it on a GPU, without a GPU.

The graph a ``tf.function`` builds is not the graph TensorFlow runs: grappler rewrites it first (it may,
for example, bypass an ``Identity`` placed on the host), and cross-device edges become ``_Send``/``_Recv``
transfers. A check of the traced graph cannot see either, so this module asks TensorFlow itself:

1. ``configure_logical_cpus()`` (before TensorFlow initialises) splits the CPU into ``/CPU:0`` (the host) and
   ``/CPU:1`` (a stand-in for the GPU). ``trace_training_step`` builds one training step (forward, loss,
   ``tape.gradient``, optimizer update) under ``tf.device("/CPU:1")``; nothing is executed.
2. ``to_virtual_devices`` maps the GraphDef onto a virtual machine: ``/CPU:1`` and unplaced nodes go to
   ``GPU:0``, ``/CPU:0`` nodes stay on the host CPU. Captured variables arrive as resource placeholders that
   carry no shape, so ``resolve_variable_shapes`` turns each into a ``VarHandleOp`` with the variable's
   shape and dtype: shape inference then knows every weight, hence every activation
   (``MemoryPeak.unknown_shape_tensors`` counts GPU tensors whose shape was still not inferred).
3. ``optimize`` runs grappler's default pipeline (the one every ``tf.function`` gets; a default
   ``RewriterConfig``) against a grappler ``VirtualCluster`` made of that GPU and the host CPU. Because the
   cluster has a GPU, the layout optimiser converts convolutions to NCHW as it would on a real one.
4. ``schedule`` runs TensorFlow's virtual scheduler on the optimised graph (``Cluster.MeasureCosts`` with a
   timeline). Each device runs one op at a time, in the order ops become ready (inputs and control inputs,
   across devices too), with analytical op costs. Every data edge between devices becomes a ``_Send`` (on a
   "Channel" device) and a ``_Recv`` on the receiving device; the ``_Recv``'s only input is the ``_Send``,
   so it runs as soon as the sending side has produced the tensor, whatever the receiving side is doing.
   That is exactly TensorFlow's behaviour, and why a copy back to the GPU must be held back on the host.
5. ``peak_memory`` replays that timeline: a tensor occupies its device from its producer's start to the end
   of its last consumer on that device (the ``_Send`` counts as a consumer on the sending side); a tensor
   received from another device occupies the receiving device from its ``_Recv`` to the end of its last
   consumer there. Identity-like ops (``ALIAS_OPS``) share their input's buffer; outputs nobody reads live
   for their producer's duration, the step's return values until it ends. Constants, variables and variable
   reads (which return the variable's own buffer) are static memory, not part of the timeline.

Why not ``Cluster.DeterminePeakMemoryUsage``: it rebuilds lifetimes from the same timeline
(``GraphMemory::InferFromTrace``) but matches consumers by the *graph's* input names, which name the
producer on the other device, never the ``_Recv``; a received buffer is therefore freed the instant it
arrives, so a copy brought back to the GPU too early, the failure that matters here, would be invisible. It
also counts every ``ReadVariableOp`` as a fresh allocation. Its number is kept as a diagnostic
(``Simulation.graph_memory_peak_bytes``).

The peak reported is ``static_bytes`` (model and optimizer variables, resident on the GPU) plus the
timeline's peak. Not modelled: allocator rounding and fragmentation, cuDNN workspaces, the host link's
bandwidth (a transfer takes (almost) no time; it changes when a copy completes, not when its buffer is allocated), and
GPU-only grappler rewrites that a CPU-only TensorFlow build does not perform (the remapper's Conv+BiasAdd+Relu
fusions).
"""

from __future__ import annotations

import dataclasses
import time

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
STAND_IN = "/CPU:1"  # where the model, its variables and the step are traced; becomes GPU
HOST_STAND_IN = "/CPU:0"  # host placement in the traced graph; stays on the host CPU
SWAP_MARKERS = ("lms_swap_out", "lms_swap_in")

# Ops whose kernels return their input's buffer (no new allocation).
ALIAS_OPS = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                       "PreventGradient", "EnsureShape", "CheckNumerics"})
# Ops whose outputs are static memory: constants, variables and variable reads.
STATIC_OPS = frozenset({"Const", "HostConst", "VarHandleOp", "ReadVariableOp", "VariableV2", "_VarHandlesOp",
                        "_ReadVariablesOp"})

# VirtualCluster.Run fails (RESOURCE_EXHAUSTED, no timeline) when the peak reaches the device's memory_size, so
# the simulated GPU is given 1 TiB; whether a step fits a real size is judged from the peak afterwards.
_DEFAULT_GPU_MEMORY = 1 << 40


def configure_logical_cpus() -> None:
    """Split the physical CPU into /CPU:0 (host) and /CPU:1 (GPU stand-in). Call before TensorFlow starts."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is not None and len(existing) >= 2:
        return
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


# ------------------------------------------------------------------------------------------- the machine
def gpu_properties(memory_bytes: int = _DEFAULT_GPU_MEMORY):
    """A V100-class GPU (80 SMs at 1.53 GHz, 900 GB/s): op costs, hence op order, and the layout depend on it."""
    from tensorflow.core.protobuf import device_properties_pb2 as dp

    return dp.NamedDevice(name=GPU, properties=dp.DeviceProperties(
        type="GPU", vendor="NVIDIA", model="virtual-gpu", frequency=1530, num_cores=80,
        environment={"architecture": "7.0", "cuda": "12000", "cudnn": "9000"}, num_registers=65536,
        l1_cache_size=128 << 10, l2_cache_size=6 << 20, shared_memory_size_per_multiprocessor=96 << 10,
        memory_size=memory_bytes, bandwidth=900_000_000))  # bandwidth in KB/s


def host_properties():
    """The host CPU: 16 cores at 2.5 GHz, 100 GB/s memory bandwidth, plenty of memory."""
    from tensorflow.core.protobuf import device_properties_pb2 as dp

    return dp.NamedDevice(name=HOST, properties=dp.DeviceProperties(
        type="CPU", vendor="GenuineIntel", model="virtual-host", frequency=2500, num_cores=16,
        l1_cache_size=32 << 10, l2_cache_size=1 << 20, l3_cache_size=32 << 20, memory_size=1 << 40,
        bandwidth=100_000_000))


def virtual_cluster(timeline: bool = True):
    """A grappler VirtualCluster: one GPU and the host CPU (nothing runs; op costs are analytical)."""
    from tensorflow.python.grappler import cluster as gcluster

    return gcluster.Cluster(devices=[gpu_properties(), host_properties()], disable_timeline=not timeline)


# ---------------------------------------------------------------------------------------- the step graph
@dataclasses.dataclass
class TracedStep:
    """One training step as a GraphDef, the nodes to fetch, and the bytes of the variables it updates."""

    graph_def: object
    fetch: list
    static_bytes: int


def _variable_bytes(variables) -> int:
    import numpy as np

    return sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in variables)


def trace_training_step(model, x_shape, y_shape, dtype="float32", optimizer="adam") -> TracedStep:
    """Trace loss = mean((model(x, training=True) - y)^2), its gradients and (optionally) their update.

    ``optimizer``: "adam" (default; two slots per weight, as ``keras_lms.report`` assumes), "sgd", or None to
    return the gradients instead (they then live until the step ends). An update makes the gradients live
    until they are applied, as in ``fit``. Inputs are function arguments (placeholders), not constants, so
    a large batch costs nothing to trace; they are pinned to the stand-in device first because keras-lms
    places a layer's backward on its input's device.
    """
    import keras
    import tensorflow as tf

    variables = model.trainable_variables
    opt = None
    if optimizer is not None:
        with tf.device(STAND_IN):
            opt = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}[optimizer](1e-3)
            opt.build(variables)

    @tf.function(jit_compile=False, autograph=False)
    def step(x, y):
        with tf.device(STAND_IN):
            x, y = tf.identity(x), tf.identity(y)
            with tf.GradientTape() as tape:
                # Under mixed precision the model returns float16: the loss is computed in float32, as Keras does.
                loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), y.dtype) - y))
            grads = tape.gradient(loss, variables)
            if opt is None:
                return loss, grads
            opt.apply(grads, variables)
        return loss

    concrete = step.get_concrete_function(tf.TensorSpec(x_shape, dtype), tf.TensorSpec(y_shape, dtype))
    func_graph = concrete.graph
    graph_def = func_graph.as_graph_def()
    resolve_variable_shapes(graph_def, func_graph)
    to_virtual_devices(graph_def)
    fetch = [t.op.name for t in func_graph.outputs] + [op.name for op in func_graph.control_outputs]
    static = _variable_bytes(model.variables) + (_variable_bytes(opt.variables) if opt is not None else 0)
    return TracedStep(graph_def, list(dict.fromkeys(fetch)), static)


def resolve_variable_shapes(graph_def, func_graph) -> int:
    """Turn each captured variable's resource placeholder into a ``VarHandleOp`` of its shape and dtype.

    A captured handle reaches the GraphDef as ``Placeholder(dtype=resource)`` without shape: shape inference
    then cannot know a weight's shape, a convolution's output shape becomes unknown and its memory reads as
    (almost) nothing. The handle's shape travels only in Python-side handle data, which is read here.
    Returns the number of placeholders rewritten.
    """
    import tensorflow as tf
    from tensorflow.python.ops import handle_data_util

    shapes = {}
    for _, internal in func_graph.captures:
        if internal.dtype != tf.resource:
            continue
        data = handle_data_util.get_resource_handle_data(internal)
        if data.is_set and data.shape_and_type:
            shapes[internal.op.name] = data.shape_and_type[0]
    for node in graph_def.node:
        entry = shapes.get(node.name)
        if entry is None or node.op != "Placeholder":
            continue
        node.op = "VarHandleOp"
        node.ClearField("attr")
        node.attr["dtype"].type = entry.dtype
        node.attr["shape"].shape.CopyFrom(entry.shape)
        node.attr["shared_name"].s = node.name.encode()
        node.attr["container"].s = b""
    return len(shapes)


def virtual_device(device: str) -> str:
    """The virtual machine's device for a traced node: the host stays on the CPU, everything else is GPU."""
    import tensorflow as tf

    if not device:
        return GPU
    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type or "").upper() == "CPU" and (spec.device_index or 0) == 0:
        return HOST
    return GPU


def to_virtual_devices(graph_def) -> None:
    """Place every node (and every node of library functions) on the virtual GPU or the host, in place."""
    for node in graph_def.node:
        node.device = virtual_device(node.device)
    for function in graph_def.library.function:
        for node in function.node_def:
            node.device = virtual_device(node.device)


def _metagraph(graph_def, fetch):
    from tensorflow.core.protobuf import meta_graph_pb2

    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph_def)
    metagraph.collection_def["train_op"].node_list.value.extend(fetch)  # the GrapplerItem's fetch nodes
    return metagraph


def optimize(graph_def, fetch, cluster):
    """Grappler's default pipeline (default RewriterConfig) for this cluster: the graph TensorFlow runs."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.grappler import tf_optimizer

    return tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), _metagraph(graph_def, fetch), verbose=False,
                                      cluster=cluster)


def schedule(graph_def, fetch, cluster):
    """The virtual scheduler's timeline of ``graph_def`` (StepStats) and the GrapplerItem it ran."""
    from tensorflow.python.grappler import item as gitem

    item = gitem.Item(_metagraph(graph_def, fetch))
    _, _, step_stats = cluster.MeasureCosts(item)
    return step_stats, item


# ------------------------------------------------------------------------------------------ the timeline
@dataclasses.dataclass
class _Op:
    """One op of the scheduler's timeline."""

    device: str
    start: int  # ns
    end: int  # ns
    sizes: list  # bytes per output
    unknown_shapes: int  # outputs whose shape inference failed


@dataclasses.dataclass
class _Buffer:
    device: str
    size: int
    start: int
    end: int
    name: str
    origin: str = ""  # for a received copy: the device it came from


@dataclasses.dataclass
class MemoryPeak:
    """Peak of the step's timeline on one device (dynamic memory only), and what is live at that moment."""

    peak_bytes: int
    at_ns: int
    live: list  # (bytes, tensor name) at the peak, largest first
    received_bytes: int  # bytes this device received from other devices in the step
    sent_bytes: int  # bytes this device sent to other devices
    unknown_shape_tensors: int  # outputs on this device whose shape inference failed


def _timeline(step_stats) -> dict:
    """node name -> _Op, for every op the virtual scheduler ran (scheduler-made _Send/_Recv included)."""
    ops = {}
    for dev_stats in step_stats.dev_stats:
        for stats in dev_stats.node_stats:
            sizes, unknown = [], 0
            for output in stats.output:
                desc = output.tensor_description
                sizes.append(int(desc.allocation_description.allocated_bytes))
                unknown += bool(desc.shape.unknown_rank or any(d.size < 0 for d in desc.shape.dim))
            start = int(stats.all_start_nanos)
            ops[stats.node_name] = _Op(dev_stats.device, start, start + int(stats.op_end_rel_nanos), sizes, unknown)
    return ops


def _parse_input(raw: str):
    name, _, port = raw.partition(":")
    return name, int(port) if port else 0


def _sanitized(device: str) -> str:
    return device.replace(":", "_")  # how the virtual scheduler spells a device inside _Send/_Recv names


class _Lifetimes:
    """Buffers of one scheduled step and how long each lives (see the module docstring, point 5)."""

    def __init__(self, graph_def, ops: dict):
        self.ops = ops
        self.nodes = {n.name: n for n in graph_def.node if n.name in ops}
        self.static = {name for name, node in self.nodes.items() if node.op in STATIC_OPS}
        self.owner = {}  # (node, port) -> the buffer it is a view of
        self.buffers = {}  # (node, port) or (_Recv name, 0) -> _Buffer

    def key(self, name, port):
        return self.owner.get((name, port), (name, port))

    def allocate(self):
        """One buffer per output, in start order so that a view's source is known before the view."""
        for name in sorted(self.nodes, key=lambda n: self.ops[n].start):
            if name in self.static:
                continue
            node, op = self.nodes[name], self.ops[name]
            data_inputs = [i for i in node.input if not i.startswith("^")]
            for port, size in enumerate(op.sizes):
                if node.op in ALIAS_OPS and port < len(data_inputs) and self._alias(name, port, node, data_inputs):
                    continue
                self.buffers[(name, port)] = _Buffer(op.device, size, op.start, op.end, f"{name}:{port}")

    def _alias(self, name, port, node, data_inputs) -> bool:
        """Make output ``port`` of a view op share its source's buffer; False if the source is elsewhere."""
        src, src_port = _parse_input(data_inputs[port if node.op == "IdentityN" else 0])
        if src not in self.ops or self.ops[src].device != self.ops[name].device:
            return False
        if src in self.static:  # a view of a variable or a constant is static too
            self.static.add(name)
        else:
            self.owner[(name, port)] = self.key(src, src_port)
        return True

    def extend(self):
        """Each buffer lives until its last consumer on its device has finished."""
        for name, node in self.nodes.items():
            op = self.ops[name]
            for raw in node.input:
                if raw.startswith("^"):
                    continue
                src, port = _parse_input(raw)
                if src not in self.ops:
                    continue
                if self.ops[src].device == op.device:
                    self._extend(self.key(src, port), op.end)
                else:
                    self._transfer(src, port, op.device, op.end)

    def _extend(self, key, end):
        buf = self.buffers.get(key)
        if buf is not None:
            buf.end = max(buf.end, end)

    def _transfer(self, src, port, device, consumer_end):
        """Cross-device edge: the source lives until its _Send ends; the copy from its _Recv to its last use."""
        src_op = self.ops[src]
        send = self.ops.get(f"Send_{src}_{port}_from_{_sanitized(src_op.device)}_to_{_sanitized(device)}")
        if send is not None:
            self._extend(self.key(src, port), send.end)
        recv_name = f"Recv_{src}_{port}_on_{_sanitized(device)}"
        recv = self.ops.get(recv_name)
        if recv is None:
            return
        key = (recv_name, 0)
        if key not in self.buffers:
            size = src_op.sizes[port] if port < len(src_op.sizes) else 0
            self.buffers[key] = _Buffer(device, size, recv.start, recv.end, f"{src}:{port} (received)",
                                        src_op.device)
        self._extend(key, consumer_end)

    def keep_until_end(self, fetch):
        """The step's return values live until it ends."""
        end = max((op.end for op in self.ops.values()), default=0)
        for name in fetch:
            for port in range(len(self.ops[name].sizes) if name in self.ops else 0):
                self._extend(self.key(name, port), end)


def buffers(graph_def, step_stats, fetch=()) -> list:
    """Every buffer of the scheduled step with its device, size and lifetime [start, end] in ns."""
    lifetimes = _Lifetimes(graph_def, _timeline(step_stats))
    lifetimes.allocate()
    lifetimes.extend()
    lifetimes.keep_until_end(fetch)
    return list(lifetimes.buffers.values())


def _peak(buffers) -> tuple:
    """(peak bytes, time, buffers live then) of intervals [start, end]; frees are due 1 ns after the end."""
    events = sorted([(b.start, 1, i) for i, b in enumerate(buffers)]
                    + [(b.end + 1, 0, i) for i, b in enumerate(buffers)])
    current, peak, at, live, best = 0, 0, 0, set(), set()
    for n, (t, allocated, i) in enumerate(events):  # at one instant, frees (0) come before allocations (1)
        current += buffers[i].size if allocated else -buffers[i].size
        (live.add if allocated else live.discard)(i)
        if (n + 1 == len(events) or events[n + 1][0] != t) and current > peak:
            peak, at, best = current, t, set(live)
    return peak, at, [buffers[i] for i in best]


def peak_memory(graph_def, step_stats, device: str = GPU, fetch=()) -> MemoryPeak:
    """Replay the timeline: the peak of live bytes on ``device`` and the tensors live at that moment."""
    every = [b for b in buffers(graph_def, step_stats, fetch) if b.size > 0]
    here = [b for b in every if b.device == device]
    peak, at, live = _peak(here)
    received = sum(b.size for b in here if b.origin)
    sent = sum(b.size for b in every if b.origin == device)
    unknown = sum(op.unknown_shapes for op in _timeline(step_stats).values() if op.device == device)
    return MemoryPeak(peak, at, sorted(((b.size, b.name) for b in live), reverse=True), received, sent, unknown)


# ----------------------------------------------------------------------------------------- all together
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


def count_named(graph_def, markers=SWAP_MARKERS) -> dict:
    """marker -> number of nodes whose name contains it (the keras-lms swap ops)."""
    return {m: sum(m in node.name for node in graph_def.node) for m in markers}


def simulate(model, x_shape, y_shape, dtype="float32", optimizer="adam", graph_memory: bool = True) -> Simulation:
    """Trace, optimise and schedule one training step of ``model``; see the module docstring."""
    start = time.perf_counter()
    traced = trace_training_step(model, x_shape, y_shape, dtype, optimizer)
    cluster = virtual_cluster()
    try:
        optimized = optimize(traced.graph_def, traced.fetch, cluster)
        step_stats, item = schedule(optimized, traced.fetch, cluster)
        gpu = peak_memory(optimized, step_stats, GPU, traced.fetch)
        grappler_peak = -1
        if graph_memory:
            grappler_peak = int(cluster.DeterminePeakMemoryUsage(item).get(GPU, (-1, []))[0])
    finally:
        cluster.Shutdown()
    return Simulation(traced.static_bytes + gpu.peak_bytes, traced.static_bytes, gpu, grappler_peak,
                      count_named(traced.graph_def), count_named(optimized), len(traced.graph_def.node),
                      len(optimized.node), time.perf_counter() - start)
