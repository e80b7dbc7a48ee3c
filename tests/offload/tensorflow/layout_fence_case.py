"""Run in a fresh process by test_layout_fence.py (the logical CPUs must be set before TensorFlow starts).

    python layout_fence_case.py [--unfenced | --fence-every-piece [--parts-unordered]] EDGE SLAB_BYTES

A wrapped float32 3D U-Net (two levels) computed in slabs: grappler's memory estimate (what its memory
optimizer decides by), the simulated peak, and the layout optimiser's most transposes of one full-resolution
tensor before the memory pass. ``--unfenced`` replaces ``slabs.layout_fence`` by the identity: the slabs as
they were before issue 28 (the control). ``--fence-every-piece`` also fences the gradient pieces of a
concatenation's part whose producer runs whole (the up-sampling's gradient), as before issue 26's exact rows:
the control of ``SlabCalls._fenced_gradients``. ``--parts-unordered`` concatenates a slab reader's input
gradients as the scheduler likes (``slabs.ASSEMBLE_IN_TURN`` off: the control of ``slabs.assembled_in_turn``).
Also counts, in the graph grappler optimised, the readers of an assembled part that do not wait for the last part's
concatenation. Prints one JSON object.
"""

import collections
import json
import os
import pathlib
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

from keras_lms.testing.logical_devices import HOST_STAND_IN, configure_logical_cpus

configure_logical_cpus()

import numpy as np  # noqa: E402

import keras_lms  # noqa: E402
from benchmarks.models import build_unet  # noqa: E402
from keras_lms.offload.tensorflow import slabs  # noqa: E402
from keras_lms.offload.tensorflow.slab_calls import SlabCalls  # noqa: E402
from keras_lms.testing import simulated_gpu, virtual_cluster  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
if "--unfenced" in sys.argv:
    slabs.layout_fence = lambda x: x
if "--fence-every-piece" in sys.argv:
    SlabCalls._fenced_gradients = lambda self, record: None
if "--parts-unordered" in sys.argv:
    slabs.ASSEMBLE_IN_TURN = False
edge, slab_bytes = int(args[0]), args[1]
model = keras_lms.wrap(build_unet((edge, edge, edge, 1), depth=2, base_filters=16, dropout=0),
                       host_device=HOST_STAND_IN, slab_bytes=slab_bytes, min_bytes=0)
shape = (1, edge, edge, edge, 1)

sim = simulated_gpu.simulate(model, shape, shape, grappler_estimate=True, graph_memory=False)
before_memory_pass = sim.before_memory_pass
# layout transposes per source tensor, among the full-resolution ones (a quarter of the largest tensor or more)
properties = virtual_cluster.grappler_item(before_memory_pass, sim.fetch).GetOpProperties()
size = {}
for node, outputs in properties.items():
    for port, out in enumerate(outputs):
        if not out.shape.unknown_rank and all(d.size > 0 for d in out.shape.dim):
            size[f"{node}:{port}" if port else node] = np.prod([d.size for d in out.shape.dim])
large = max(size.values()) / 4
per_source = collections.Counter(node.input[0] for node in before_memory_pass.node
                                 if node.op == "Transpose" and "LayoutOptimizer" in node.name
                                 and size.get(node.input[0], 0) >= large)


def parts_handed_early(graph_def):
    """(assemblies of several parts, data readers of a part that are not descendants of the last part's
    concatenation) in ``graph_def``, from the names ``slabs.assembled_in_turn`` gives its concatenations."""
    readers, data_readers = collections.defaultdict(list), collections.defaultdict(list)
    for n in graph_def.node:
        for i in n.input:
            readers[i.lstrip("^").split(":")[0]].append(n.name)
            if not i.startswith("^"):
                data_readers[i.split(":")[0]].append(n.name)

    groups = collections.defaultdict(dict)  # assembly -> part index -> its concatenation
    for n in graph_def.node:
        named = re.fullmatch(rf".*{slabs.PARTS_CONCAT}_(\d+)_part(\d+)", n.name)
        if n.op == "ConcatV2" and named:
            groups[named.group(1)][int(named.group(2))] = n.name
    assemblies, early = 0, 0
    for names in groups.values():
        if len(names) < 2:
            continue
        assemblies += 1
        *parts, last = [names[k] for k in sorted(names)]
        after_last, stack = set(), [last]  # every node that waits for the last concatenation (data or control)
        while stack:
            for reader in readers[stack.pop()]:
                if reader not in after_last:
                    after_last.add(reader)
                    stack.append(reader)
        early += sum(reader not in after_last for part in parts for reader in data_readers[part])
    return assemblies, early


assemblies, early = parts_handed_early(sim.optimized)
print(json.dumps(dict(peak=sim.peak_bytes, static=sim.static_bytes, estimate=sim.grappler_estimate_bytes,
                      parts_assemblies=assemblies, parts_readers_before_last=early,
                      most_transposes_of_one_tensor=max(per_source.values(), default=0),
                      fences=sum(slabs.LAYOUT_FENCE in n.name for n in before_memory_pass.node))))
