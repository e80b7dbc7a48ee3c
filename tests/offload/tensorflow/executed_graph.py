"""What TensorFlow *executes* for one training step: the partition graphs after grappler, per device.

A check of the traced graph is not a check of what runs: grappler rewrites every tf.function before it is
partitioned per device, and in 0.1.0 it removed the whole offload while every traced-graph test passed.
This module runs one step with run metadata enabled and reads the partition graphs (one GraphDef per
device, cross-device edges turned into ``_Send``/``_Recv`` pairs), stitched back into one graph.

It needs two logical CPU devices, configured before TensorFlow initialises (``configure_two_cpus``): the
step runs under ``tf.device(COMPUTE)`` as the stand-in for an accelerator, host copies go to ``HOST``.

The two counts the executed-graph tests assert on (issue 9), defined without reference to our own op names,
so they apply to the plain model and to any offload mechanism alike:

* **device-resident reads**: forward activations (rank >= 2, float, at least ``min_bytes``) produced on the
  compute device and read there by backward ops, i.e. kept on the device from the forward to the backward
  pass. A tensor the wrapper meant to offload but that is read this way is **bypassed**.
* **ungated transfers**: a host -> compute transfer carrying a host copy of a forward activation whose
  sending op does not depend on the backward pass. Its device-side ``_Recv`` completes as soon as the host
  sends, i.e. in the forward pass, so the copy back occupies the device from the forward to the backward.

"Backward" = every node downstream (data or control, across devices) of the step's ``dy`` argument, the
upstream gradient fed to ``tape.gradient``; "forward" = everything else.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from keras_lms.testing.logical_devices import configure_logical_cpus

HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
COMPUTE = "/job:localhost/replica:0/task:0/device:CPU:1"
DY_ARG = "lms_test_dy"


# CPU:0 is the host, CPU:1 the compute device: the same split the GPU simulation uses.
configure_two_cpus = configure_logical_cpus


@dataclasses.dataclass
class Tensor:
    name: str  # "node:index"
    shape: tuple
    nbytes: int


@dataclasses.dataclass
class ExecutedStep:
    """The partition graphs of one step, stitched, with forward/backward classification."""

    nodes: dict  # name -> NodeDef (names are unique across partitions)
    device: dict  # name -> device
    consumers: dict  # tensor "node:i" -> list of consumer node names (data edges, stitched across devices)
    parents: dict  # node name -> list of (tensor or None for control, parent node name)
    backward: set  # node names downstream of dy
    shapes: dict  # tensor "node:i" -> (shape, dtype) from the traced (pre-grappler) graph
    swap_out_sources: set  # traced-graph tensors fed to a host op named like the swap-out (may be empty)

    # ------------------------------------------------------------------ helpers
    def tensor_info(self, tensor):
        shape, dtype = self.shapes.get(tensor, (None, None))
        if shape is None or dtype is None or any(d is None for d in shape):
            return None
        return Tensor(tensor, tuple(shape), int(np.prod(shape, dtype=np.int64)) * dtype.size)

    def is_activation(self, tensor, min_bytes):
        info = self.tensor_info(tensor)
        node = self.nodes.get(tensor.split(":")[0])
        if info is None or node is None or len(info.shape) < 2 or info.nbytes < min_bytes:
            return False
        dtype = self.shapes[tensor][1]
        return dtype.is_floating and node.op not in ("ReadVariableOp", "Const", "_Arg", "_Recv")

    def ancestors(self, name):
        seen, stack = set(), [name]
        while stack:
            for _, parent in self.parents.get(stack.pop(), []):
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return seen

    # ------------------------------------------------------------------ the two counts
    def device_resident_reads(self, min_bytes=1):
        """Forward activations on the compute device read by backward ops on the compute device."""
        reads = {}
        for tensor, users in self.consumers.items():
            producer = tensor.split(":")[0]
            if producer in self.backward or self.device.get(producer) != COMPUTE:
                continue
            if not self.is_activation(tensor, min_bytes):
                continue
            readers = [u for u in users if u in self.backward and self.device.get(u) == COMPUTE]
            if readers:
                reads[tensor] = readers
        return reads

    def host_copies(self, min_bytes=1):
        """Host nodes holding (data-downstream of) a forward activation received from the compute device."""
        held = set()
        stack = []
        for name, node in self.nodes.items():
            if node.op == "_Recv" and self.device[name] == HOST and name not in self.backward:
                source = self._send_input(node)
                if source is not None and self.is_activation(source, min_bytes):
                    held.add(name)
                    stack.append(name)
        while stack:
            name = stack.pop()
            for out in self._outputs(name):
                for user in self.consumers.get(out, []):
                    if self.device.get(user) == HOST and user not in held and self.nodes[user].op != "_Send":
                        held.add(user)
                        stack.append(user)
        return held

    def transfers_back(self, min_bytes=1):
        """(host _Send node, the host node it sends) for every host copy sent back to the compute device."""
        held = self.host_copies(min_bytes)
        out = []
        for name, node in self.nodes.items():
            if node.op == "_Send" and self.device[name] == HOST and node.attr["recv_device"].s.decode() == COMPUTE:
                data = [i for i in node.input if not i.startswith("^")]
                if data and data[0].split(":")[0] in held:
                    out.append((name, data[0].split(":")[0]))
        return out

    def ungated_transfers(self, min_bytes=1):
        """Transfers of host copies back to the compute device that do not wait for the backward pass."""
        return [(send, src) for send, src in self.transfers_back(min_bytes)
                if not (self.ancestors(send) & self.backward)]

    def bypassed(self, min_bytes=1):
        """Tensors the wrapper sent to a swap-out op that the backward still reads on the compute device."""
        resident = self.device_resident_reads(min_bytes)
        return {t: r for t, r in resident.items() if t in self.swap_out_sources}

    # ------------------------------------------------------------------ internals
    def _outputs(self, name):
        return [t for t in self.consumers if t.split(":")[0] == name]

    def _send_input(self, recv_node):
        send = self._send_for.get(_rendezvous_key(recv_node))
        if send is None:
            return None
        data = [i for i in send.input if not i.startswith("^")]
        return _canonical(data[0]) if data else None


def _canonical(tensor):
    return tensor if ":" in tensor else f"{tensor}:0"


def _rendezvous_key(node):
    a = node.attr
    return a["tensor_name"].s, a["send_device"].s, a["recv_device"].s


def _through_identities(tensor):
    """The tensor behind Identity/IdentityN wrappers (custom_gradient adds them; grappler removes them)."""
    while tensor.op.type in ("Identity", "IdentityN"):
        tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
    return tensor


def stitch(partition_graphs, traced_graph, swap_out_prefix="lms_swap_out"):
    """One ExecutedStep from the partition graphs and the traced tf.function graph (for static shapes)."""
    nodes, device = {}, {}
    for pg in partition_graphs:
        for node in pg.node:
            nodes[node.name] = node
            device[node.name] = node.device
    send_for = {_rendezvous_key(n): n for n in nodes.values() if n.op == "_Send"}
    parents = collections.defaultdict(list)
    consumers = collections.defaultdict(list)
    for name, node in nodes.items():
        for inp in node.input:
            if inp.startswith("^"):
                parents[name].append((None, inp[1:]))
                continue
            tensor = _canonical(inp)
            parents[name].append((tensor, tensor.split(":")[0]))
            consumers[tensor].append(name)
        if node.op == "_Recv":
            send = send_for.get(_rendezvous_key(node))
            if send is not None:
                parents[name].append((None, send.name))
                # The data a _Recv yields is its _Send's input: stitch the edge through.
                data = [i for i in send.input if not i.startswith("^")]
                if data:
                    for user in list(consumers.get(f"{name}:0", [])):
                        consumers[_canonical(data[0])].append(user)
    # Forward/backward split: downstream of the dy argument.
    children = collections.defaultdict(set)
    for name, plist in parents.items():
        for _, parent in plist:
            children[parent].add(name)
    starts = [n for n, node in nodes.items() if node.op == "_Arg" and n.startswith(DY_ARG)]
    if not starts:
        raise AssertionError(f"no _Arg named {DY_ARG!r} in the partition graphs")
    backward, stack = set(starts), list(starts)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in backward:
                backward.add(child)
                stack.append(child)
    shapes, swap_sources = {}, set()
    for op in traced_graph.get_operations():
        for i, t in enumerate(op.outputs):
            shapes[f"{op.name}:{i}"] = (t.shape.as_list() if t.shape.rank is not None else None, t.dtype)
        if op.name.rsplit("/", 1)[-1].startswith(swap_out_prefix):
            swap_sources.add(_through_identities(op.inputs[0]).name)
    # Receivers' data tensors carry the sender's shape.
    for name, node in nodes.items():
        if node.op == "_Recv":
            send = send_for.get(_rendezvous_key(node))
            data = [i for i in send.input if not i.startswith("^")] if send is not None else []
            if data and _canonical(data[0]) in shapes:
                shapes[f"{name}:0"] = shapes[_canonical(data[0])]
    step = ExecutedStep(dict(nodes), device, dict(consumers), dict(parents), backward, shapes, swap_sources)
    step._send_for = send_for
    return step


def run_step(model, x, y=None, device=COMPUTE):
    """Run one forward + backward of ``model`` on ``device`` (COMPUTE; None: wherever TensorFlow places it, no
    second logical device needed) and return the ExecutedStep.

    The upstream gradient of the output is the function argument ``lms_test_dy`` (mean-squared-error's
    gradient computed outside), so the backward pass has a well-defined start in the executed graph.
    """
    import contextlib

    import tensorflow as tf
    from tensorflow.python.eager import context

    with tf.device(device) if device is not None else contextlib.nullcontext():
        out = model(x, training=False)
        dy = tf.nest.map_structure(lambda o: tf.ones_like(o) / np.prod(o.shape), out)

        @tf.function(autograph=False)
        def step(x, lms_test_dy):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
            return tape.gradient(out, model.trainable_variables, output_gradients=lms_test_dy)

        concrete = step.get_concrete_function(x, dy)
        ctx = context.context()
        ctx.enable_run_metadata()
        try:
            step(x, dy)
            metadata = ctx.export_run_metadata()
        finally:
            ctx.disable_run_metadata()
    graphs = [pg for fg in metadata.function_graphs for pg in fg.partition_graphs]
    devices = {n.device for pg in graphs for n in pg.node}
    if device is not None and device not in devices:
        raise AssertionError(f"the step did not run on {device}: partitions on {sorted(devices)}")
    return stitch(graphs, concrete.graph)
