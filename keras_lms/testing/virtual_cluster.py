"""A virtual machine for grappler: one V100-class GPU and the host CPU, and grappler's passes run against it.

Nothing executes on it. Op costs are analytical, derived from the devices' properties, so the devices decide the
order the virtual scheduler gives the ops and, because the cluster has a GPU, grappler's layout optimiser
converts convolutions to NCHW as it would on a real one. ``optimize`` gives the graph TensorFlow would run;
``schedule`` the timeline the virtual scheduler makes of it (keras_lms/testing/timeline_peak.py replays it).

The GPU's ``memory_size`` matters to one pass: grappler's memory optimizer inserts swaps of its own when its
estimate of the graph (``grappler_memory_estimate``) exceeds it (keras_lms/testing/grappler_swaps.py). A
cluster made with the real device's size optimises as TensorFlow would on that device; the schedule is always
taken on a 1 TiB cluster, because the virtual scheduler refuses to run a graph its estimate says does not fit.
"""

from __future__ import annotations

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
HOST = "/job:localhost/replica:0/task:0/device:CPU:0"

# VirtualCluster.Run fails (RESOURCE_EXHAUSTED, no timeline) when the peak reaches the device's memory_size, so
# the simulated GPU is given 1 TiB; whether a step fits a real size is judged from the peak afterwards.
_DEFAULT_GPU_MEMORY = 1 << 40


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


def virtual_cluster(timeline: bool = True, gpu_memory_bytes: int = _DEFAULT_GPU_MEMORY):
    """A grappler VirtualCluster: one GPU of ``gpu_memory_bytes`` and the host CPU (nothing runs; op costs are
    analytical). Without a timeline, ``Cluster.DeterminePeakMemoryUsage`` infers statically, as grappler's
    memory optimizer does."""
    from tensorflow.python.grappler import cluster as gcluster

    return gcluster.Cluster(devices=[gpu_properties(gpu_memory_bytes), host_properties()],
                            disable_timeline=not timeline)


def _metagraph(graph_def, fetch):
    from tensorflow.core.protobuf import meta_graph_pb2

    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph_def)
    metagraph.collection_def["train_op"].node_list.value.extend(fetch)  # the GrapplerItem's fetch nodes
    return metagraph


def optimize(graph_def, fetch, cluster, until_memory_pass: bool = False, memory_optimization: int | None = None):
    """Grappler's default pipeline (default RewriterConfig) for this cluster: the graph TensorFlow runs.

    ``until_memory_pass``: the graph grappler's memory optimizer is given on its first run instead: the first
    of the meta optimizer's two iterations, without the memory pass (the passes after it, auto-parallel and the
    scoped allocator, are off by default). Its ``grappler_memory_estimate`` is what decides grappler's swaps.
    ``memory_optimization``: the memory optimizer's setting, as a wrapped step runs it
    (``offload/tensorflow/call_options.py``: no swaps of grappler's); default TensorFlow's.
    """
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer

    config = config_pb2.ConfigProto()
    if memory_optimization is not None:
        config.graph_options.rewrite_options.memory_optimization = memory_optimization
    if until_memory_pass:
        rewriter = config.graph_options.rewrite_options
        rewriter.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        rewriter.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return tf_optimizer.OptimizeGraph(config, _metagraph(graph_def, fetch), verbose=False, cluster=cluster)


def grappler_item(graph_def, fetch):
    """The GrapplerItem of ``graph_def``: what grappler's cost model and shape inference see
    (``GetOpProperties()`` gives every output's inferred shape)."""
    from tensorflow.python.grappler import item as gitem

    return gitem.Item(_metagraph(graph_def, fetch))


def grappler_memory_estimate(graph_def, fetch, gpu_memory_bytes: int = _DEFAULT_GPU_MEMORY) -> int:
    """Grappler's static estimate of ``graph_def``'s GPU peak (``GraphMemory::InferStatically``), the number its
    memory optimizer compares with the GPU's memory size before it swaps."""
    cluster = virtual_cluster(timeline=False, gpu_memory_bytes=gpu_memory_bytes)
    try:
        return int(cluster.DeterminePeakMemoryUsage(grappler_item(graph_def, fetch)).get(GPU, (-1,))[0])
    finally:
        cluster.Shutdown()


def schedule(graph_def, fetch, cluster):
    """The virtual scheduler's timeline of ``graph_def`` (StepStats) and the GrapplerItem it ran."""
    item = grappler_item(graph_def, fetch)
    _, _, step_stats = cluster.MeasureCosts(item)
    return step_stats, item
