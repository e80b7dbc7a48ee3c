"""Device memory over a scheduled step: each buffer's lifetime on the virtual scheduler's timeline, and the peak.

``peak_memory`` replays the timeline (keras_lms/testing/virtual_cluster.py, ``schedule``): a tensor occupies its
device from its producer's start to the end of its last consumer on that device (the ``_Send`` counts as a
consumer on the sending side); a tensor received from another device occupies the receiving device from its
``_Recv`` to the end of its last consumer there. Identity-like ops (``ALIAS_OPS``) share their input's buffer;
outputs nobody reads live for their producer's duration, the step's return values until it ends. Constants,
variables and variable reads (which return the variable's own buffer) are static memory, not part of the
timeline. Grappler's own swaps (keras_lms/testing/grappler_swaps.py) run on the GPU but the output of a
``_CopyFromGpuToHost`` is host memory (a GPU build gives it a host-memory output): it is counted on the host,
and its ``_CopyFromHostToGpu`` is a copy received from the host, from its start (gated by grappler's trigger)
to its consumer's end.

Why not ``Cluster.DeterminePeakMemoryUsage``: it rebuilds lifetimes from the same timeline
(``GraphMemory::InferFromTrace``) but matches consumers by the *graph's* input names, which name the
producer on the other device, never the ``_Recv``; a received buffer is therefore freed the instant it
arrives, so a copy brought back to the GPU too early, the failure that matters here, would be invisible. It
also counts every ``ReadVariableOp`` as a fresh allocation. Its number is kept as a diagnostic
(``Simulation.graph_memory_peak_bytes`` in keras_lms/testing/simulated_gpu.py).
"""

from __future__ import annotations

import dataclasses

from keras_lms.testing.grappler_swaps import SWAP_IN_OP, SWAP_OUT_OP
from keras_lms.testing.virtual_cluster import GPU, HOST

# Ops whose kernels return their input's buffer (no new allocation).
ALIAS_OPS = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                       "PreventGradient", "EnsureShape", "CheckNumerics"})
# Ops whose outputs are static memory: constants, variables and variable reads.
STATIC_OPS = frozenset({"Const", "HostConst", "VarHandleOp", "ReadVariableOp", "VariableV2", "_VarHandlesOp",
                        "_ReadVariablesOp"})


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
    grappler_swap: bool = False  # the host copy of one of grappler's own swaps


@dataclasses.dataclass
class MemoryPeak:
    """Peak of the step's timeline on one device (dynamic memory only), and what is live at that moment."""

    peak_bytes: int
    at_ns: int
    live: list  # (bytes, tensor name) at the peak, largest first
    received_bytes: int  # bytes this device received from other devices in the step
    sent_bytes: int  # bytes this device sent to other devices
    unknown_shape_tensors: int  # outputs on this device whose shape inference failed
    grappler_swap_bytes: int = 0  # of sent_bytes, those grappler's own swaps copied out (and back)


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
    """Buffers of one scheduled step and how long each lives (see the module docstring)."""

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
                device, origin = op.device, ""
                if node.op == SWAP_OUT_OP:  # grappler's swap-out: its output is in host memory, sent from the GPU
                    device, origin = HOST, op.device
                elif node.op == SWAP_IN_OP:  # ... and its swap-in a copy received from the host
                    origin = HOST
                self.buffers[(name, port)] = _Buffer(device, size, op.start, op.end, f"{name}:{port}", origin,
                                                     node.op == SWAP_OUT_OP)

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
    swapped = sum(b.size for b in every if b.origin == device and b.grappler_swap)
    unknown = sum(op.unknown_shapes for op in _timeline(step_stats).values() if op.device == device)
    return MemoryPeak(peak, at, sorted(((b.size, b.name) for b in live), reverse=True), received, sent, unknown,
                      swapped)
