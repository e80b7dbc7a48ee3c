"""What a plan moves over the host link: per layer call, the bytes copied out in its forward and back in for its
forward and its backward.

The same walk as the memory model (``memory_model.simulate``), counting transfers instead of residency:

- **out**: a tensor is copied to host once per step, in the forward of its first offloading consumer, when some
  backward reads that copy (a consumer's backward reads its inputs, or the producer's gradient reads its own
  output from it: ``BackendFacts.reads_output_host_copy``). Host copies nobody reads are pruned by TensorFlow
  and never made on torch.
- **in**: every consumer whose backward reads an offloaded input brings it back itself (once per reading
  call, not once per tensor: a U-Net skip read by a convolution and by a concatenation's reader comes back for
  each). A call whose gradient reads its own output reuses its first reader's copy back when that reader brought
  the whole tensor back, and brings it back itself otherwise.
- **recomputed tensors** (``planning.recompute``) are never copied: a read expands to reads of the host copies
  their recompute starts from. Read whole (torch), that copy back also serves the source's own reader
  (``RecomputeSource.shared_reader``), which then brings nothing back itself.
- **level sweeps** (TensorFlow, ``offload.tensorflow.sweeps``): the passes read windows of the run's input,
  widened by the halos of the convolutions they recompute, and nothing else of the run comes back.
- **slab-computed calls** bring back windows, with halos, once per pass (``BackendFacts.slab_traffic``): on
  TensorFlow a convolution's backward windows overlap by twice its halo and a BatchNormalization's backward
  reads every window twice, which is why copies back exceed copies out (about 2x on the 3D U-Net).

``keras_lms.report`` shows these totals; tests/offload/tensorflow/test_link_traffic.py checks them against the
tensors that cross between host and device in the graph grappler optimises for a virtual GPU.
"""

from __future__ import annotations

import dataclasses

from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.memory_model import tensor_sizes
from keras_lms.planning.plan import chosen_sweeps
from keras_lms.planning.recompute import active_sources, expand_read


@dataclasses.dataclass
class LinkTraffic:
    """Host-link bytes of one step, per call position (forward order).

    Attributes:
        out_bytes: device -> host bytes issued in call i's forward.
        forward_in_bytes: host -> device bytes call i's forward reads (slab windows of a skip's host copy).
        backward_in_bytes: host -> device bytes call i's backward reads.
        backward_pieces: how many pieces call i's backward reads them in (its slab count; 1 when whole).
        forward_recompute / backward_recompute: ``(kernel FLOPs, memory-bound bytes)`` call i's forward and
            backward spend recomputing windows of tensors that were not copied (``planning.recompute``).
        forward_after / backward_after: the calls whose copies out call i's forward / backward copies back read
            (a host copy can come back only once it has gone out: the step-time model waits for them).
        swept_calls: the calls of the level sweeps the plan runs and the folded poolings (``BackendFacts.
            pooling_folds``), whose backward recomputes no forward of its own
            (their passes' recompute is in ``backward_recompute``).
    """

    out_bytes: list
    forward_in_bytes: list
    backward_in_bytes: list
    backward_pieces: list
    forward_recompute: list = dataclasses.field(default_factory=list)
    backward_recompute: list = dataclasses.field(default_factory=list)
    forward_after: list = dataclasses.field(default_factory=list)
    backward_after: list = dataclasses.field(default_factory=list)
    swept_calls: frozenset = frozenset()

    @property
    def device_to_host_bytes(self) -> int:
        return int(sum(self.out_bytes))

    @property
    def host_to_device_bytes(self) -> int:
        return int(sum(self.forward_in_bytes) + sum(self.backward_in_bytes))

    @property
    def total_bytes(self) -> int:
        return self.device_to_host_bytes + self.host_to_device_bytes


@dataclasses.dataclass(frozen=True)
class SlabTraffic:
    """A slab-computed call's transfers: the host copies it reads (``(key, bytes)``, copied out once per step
    by whoever offloads them first) and the bytes its forward and backward bring back."""

    copied: tuple
    forward_in_bytes: int
    backward_in_bytes: int
    passes: int = 1  # backward passes over the windows (BatchNormalization: 2, the first one fusable)
    reads: tuple = ()  # (key, bytes, rows read, windows, "fwd" or "bwd") per tensor read
    length: int = 0  # rows of the call's inputs along the sliced axis


def link_traffic(calls, offloaded, facts, batch_size: int = 1, slab_bytes: int = 0,
                 recomputed=frozenset(), swept=None, short_chains=frozenset()) -> LinkTraffic:
    """The host-link transfers of a plan (``offloaded[i][j]``: input j of call i goes to host); see the module
    docstring. ``facts`` is the back end's ``BackendFacts``; ``slab_bytes`` the plan's slab size; ``recomputed``
    the calls whose outputs are recomputed instead of copied (``planning.recompute``); ``swept`` the level sweeps
    the plan runs, first call -> windows (``plan.planned_sweeps``; ``BackendFacts.slab_sweeps``); ``short_chains``
    the activations that take their BatchNorm's first pass (``plan.planned_short_chains``)."""
    n = len(calls)
    sizes_in, sizes_out, keys_out = tensor_sizes(calls, batch_size)
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes) if n else {}
    elided = facts.elided_concatenations(calls, slabs, batch_size) if slabs else {}
    chains = facts.fused_slab_chains(calls, offloaded, slabs, short_chains) if slabs else {}
    sources = active_sources(facts.recompute_sources(calls, offloaded, slabs, chains, batch_size), recomputed)
    fused_sources = {source for source, _ in chains.values()}
    fused_between = {between for _, between in chains.values() if between is not None}
    sweep_costs = [facts.sweep_traffic(calls, sweep, slabs, offloaded, batch_size)
                   for sweep in chosen_sweeps(facts, calls, offloaded, slabs, swept)]
    sweep_of = {s.first: s for s in sweep_costs}
    in_sweep = frozenset().union(*(s.members for s in sweep_costs))
    # a pooling whose activation's slab backward takes its gradient reads nothing (the activation recomputes it)
    folds = {p: a for p, (a, _) in facts.pooling_folds(calls, offloaded, slabs).items()
             if p not in in_sweep and a not in in_sweep} if slabs else {}
    out, fwd_in, bwd_in = [0] * n, [0] * n, [0] * n
    work = {"fwd": [[0.0, 0.0] for _ in range(n)], "bwd": [[0.0, 0.0] for _ in range(n)]}
    pieces = [slabs[i].count if i in slabs else 1 for i in range(n)]
    for sweep in sweep_costs:  # a pass reads its windows one by one, like a slab backward
        for owner, *_ in sweep.reads:
            pieces[owner] = sweep.pieces
    first_offload = {}  # key -> the first call (forward order) that offloads it
    whole_reader = {}  # key -> the first call whose backward brings the whole tensor back
    read = set()  # keys some backward reads from host
    sizes = {}
    whole_reads = {}  # (call, key) -> bytes the call's backward brings back whole
    shared = []  # recompute sources read whole, whose inputs their shared_reader takes from the recompute
    reads_of = {"fwd": [set() for _ in range(n)], "bwd": [set() for _ in range(n)]}  # host copies each reads

    def window_read(i, key, size, rows, windows, length, kind):
        """A read of windows of ``key`` by call i: from its host copy, or expanded where it is recomputed."""
        expanded = expand_read(key, size, rows, windows, length, sources)
        for leaf, (leaf_size, nbytes) in expanded.leaves.items():
            first_offload.setdefault(leaf, i)
            sizes[leaf] = leaf_size
            read.add(leaf)
            reads_of[kind][i].add(leaf)
            (fwd_in if kind == "fwd" else bwd_in)[i] += int(nbytes)
        work[kind][i][0] += expanded.flops
        work[kind][i][1] += expanded.elementwise_bytes

    for i, call in enumerate(calls):
        reads_inputs = facts.backward_reads(call.unit)[0]
        if i in elided:
            continue  # a concatenation nobody builds: its reader offloads its parts
        if i in in_sweep and i not in sweep_of:
            continue  # a level sweep's passes read for it (below, at the sweep's first call)
        if i in sweep_of:
            sweep = sweep_of[i]
            for key, _size in sweep.copied:
                first_offload.setdefault(key, i)
            slab = facts.slab_traffic(calls, i, slabs[i], offloaded[i], batch_size)
            for key, size, rows, windows, kind in slab.reads:
                if kind == "fwd":  # the forward still reads a skip's windows from its host copy
                    window_read(i, key, size, rows, windows, slab.length, kind)
            for owner, key, size, rows, windows in sweep.reads:
                window_read(owner, key, size, rows, windows, sweep.length, "bwd")
            for owner, (flops, nbytes) in sweep.work.items():
                work["bwd"][owner][0] += flops
                work["bwd"][owner][1] += nbytes
            continue
        if i in slabs:
            slab = facts.slab_traffic(calls, i, slabs[i], offloaded[i], batch_size)
            # (a fused chain's convolution reads its input's windows through the chain: ``sources``)
            keep = (slab.passes - 1) / slab.passes if i in fused_sources else 1.0
            for key, _size in slab.copied:
                first_offload.setdefault(key, i)
            if i in folds:
                work["bwd"][folds[i]][1] += call_cost(call, batch_size).forward_bytes
            for key, size, rows, windows, kind in slab.reads:
                if kind == "bwd" and i in folds:
                    continue
                if kind == "bwd" and keep != 1.0:  # its first pass runs in the chain's convolution
                    rows, windows = rows * keep, max(1, round(windows * keep))
                window_read(i, key, size, rows, windows, slab.length, kind)
            continue
        for key, size, off in zip(call.keys, sizes_in[i], offloaded[i]):
            if not off:
                continue
            if key in sources:  # never copied: recomputed whole in this backward from its source's host copies
                if reads_inputs:
                    window_read(i, key, size, 1, 1, sources[key].length, "bwd")
                    whole_reader.setdefault(key, i)
                    if sources[key].shared_reader is not None:
                        shared.append(sources[key])
                continue
            first_offload.setdefault(key, i)
            sizes[key] = size
            if reads_inputs:
                read.add(key)
                reads_of["bwd"][i].add(key)
                bwd_in[i] += size
                whole_reads[(i, key)] = size
                whole_reader.setdefault(key, i)
    for i, call in enumerate(calls):
        if (i in elided or i in fused_between or i in in_sweep or not facts.reads_output_host_copy(call.unit)
                or not facts.backward_reads(call.unit)[1]):
            continue  # (a fused chain's activation: its gradient is taken in the convolution's backward)
        for key, size in zip(keys_out[i], sizes_out[i]):
            if key not in first_offload:
                continue  # no consumer offloaded it: the output stays on the device for this backward
            if i in slabs and facts.output_gradient_activation(call.unit) is None:
                continue  # a slab-computed kernel call recomputes its activation on its input windows
            if i in slabs:
                # windows of the output's copy, which partition it (an activation's halo is 0)
                window_read(i, key, size, slabs[i].length, slabs[i].count, slabs[i].length, "bwd")
            elif key not in whole_reader:
                read.add(key)
                reads_of["bwd"][i].add(key)
                sizes.setdefault(key, size)
                bwd_in[i] += size  # brings the output back itself
    for source in shared:  # (torch) the recompute's copy back stays on the device for the input's own reader
        for key, _ in source.inputs:
            if key not in source.resident:
                bwd_in[source.shared_reader] -= whole_reads.pop((source.shared_reader, key), 0)
    for key in read:
        out[first_offload[key]] += sizes[key]
    after = {kind: [tuple(sorted({first_offload[key] for key in keys})) for keys in per_call]
             for kind, per_call in reads_of.items()}
    return LinkTraffic(out, fwd_in, bwd_in, pieces, [tuple(w) for w in work["fwd"]],
                       [tuple(w) for w in work["bwd"]], after["fwd"], after["bwd"], in_sweep | frozenset(folds))
