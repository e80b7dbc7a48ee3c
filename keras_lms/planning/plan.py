"""The plan's types: a traced layer call (``RawCall``), the decision on it (``CallDecision``), the recorded plan
entry (``PlanEntry``, what ``LMSModel.lms_plan`` lists) and tensor sizes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from keras_lms.config import format_bytes


@dataclasses.dataclass
class PlanEntry:
    """One layer call of the forward pass and what keras-lms does with its inputs.

    Attributes:
        index: position of the call in the forward pass (0-based).
        layer: the layer's (or keras.ops node's) name; ``layer_class`` its class name.
        shapes / dtypes: the call's input tensors (``None`` for a dimension unknown when traced).
        bytes: total bytes of the call's input tensors per step (unknown dimensions count as ``batch_size``
            for the first axis and 1 elsewhere).
        offloaded: whether at least one input goes to host memory between forward and backward.
        offloaded_bytes: bytes of this call's inputs that live on the host (a tensor shared by several
            calls is copied once; ``new_host_bytes`` counts it only at its first offloading call).
        output_shapes / output_bytes: the call's outputs, for the activation report.
        reason: why, in words.
        slab_bytes: on TensorFlow, the slab size an offloaded local call is computed with when its inputs are
            larger (``LMSConfig.slab_bytes``, or smaller when the budget planner chose so); 0: none.
        unoffloadable: why the back end cannot offload this call at all (a quantized layer; on torch, a layer
            that reads other layers' trainable variables), as the planning trace found; None when it can.
        recompute_from: ``(source, between)`` call indices when this call's input is not copied but recomputed
            in its backward from the host copy of call ``source``'s input through call ``between`` (TensorFlow's
            fused slab chains: BatchNormalization -> activation -> convolution); None otherwise.
        recomputed_output: the call's output is never copied to host; every backward that reads it recomputes
            its windows from this call's inputs (``planning.recompute``, chosen by the step-time model).
        recomputed_inputs: indices of the calls whose recomputed outputs this call reads (empty: none).
        sweep: the call indices of the level sweep this call belongs to (TensorFlow: a run of convolution ->
            BatchNormalization -> activation units differentiated in passes over slab windows from the run's
            input, ``offload.tensorflow.sweeps``); None otherwise.
        sweep_windows: how many slab windows that sweep's passes cut the run into (thinner windows hold less
            device memory and recompute more halo rows; the planner chooses); None outside a sweep.
        sweep_held: the unit numbers (from 1) of that sweep whose convolution outputs its passes hold on the device
            from the first pass to their own instead of convolving again (``Sweep.held``); empty: none.
        sweep_folded: ``(pooling call, stride)`` when that sweep's first pass also takes the input gradient of
            the pooling that reads the run's output (``Sweep.folded``; its windows start on multiples of the
            stride); None otherwise.
        folded_pooling: ``(pooling call, stride)`` when this activation's slab backward also takes the input
            gradient of the pooling that reads its output, window by window, where no level sweep runs it
            (TensorFlow's ``offload.tensorflow.pooling_folds``: its windows are the pooling's); None otherwise.
        slab_align: the row multiple this call's slab windows start on (1: wherever its slab size puts them): a
            folding activation's, and its BatchNorm's, are its pooling's stride (``pooling_folds.alignments``).
        parked_inputs: positions of this call's inputs that go to host memory right after it, for a far later
            reader that reads them from there a window of rows at a time (``BackendFacts.parked_inputs``: JAX's
            U-Net skips, read by the decoder's windowed convolution); empty: none.
        prefetch: how many calls ahead the step starts copies back, where the time-aware planner chose a depth
            (with ``device_profile`` and ``device_budget``: the shortest predicted step that fits); the same on
            every entry of a plan. None: ``LMSConfig.prefetch``.
        copy_back_lead: how many calls ahead this call's copies back start, where the time-aware planner starts
            them earlier than the plan's depth (a backward that waits for its copies while the budget has room
            for them to land sooner); None: ``prefetch``.
    """

    index: int
    layer: str
    layer_class: str
    shapes: list
    dtypes: list
    bytes: int
    offloaded: bool
    reason: str
    offloaded_bytes: int = 0
    new_host_bytes: int = 0
    output_shapes: list = dataclasses.field(default_factory=list)
    output_bytes: int = 0
    tensor_offloaded: list = dataclasses.field(default_factory=list)
    slab_bytes: int = 0  # the slab size of the TensorFlow slab machinery for this call (0: none)
    unoffloadable: str | None = None
    recompute_from: tuple | None = None
    recomputed_output: bool = False
    recomputed_inputs: list = dataclasses.field(default_factory=list)
    sweep: tuple | None = None
    sweep_windows: int | None = None
    sweep_held: tuple = ()
    sweep_folded: tuple | None = None
    folded_pooling: tuple | None = None
    slab_align: int = 1
    prefetch: int | None = None
    copy_back_lead: int | None = None
    parked_inputs: list = dataclasses.field(default_factory=list)

    @property
    def decision(self) -> str:
        """``keep`` (nothing of this call goes to host), ``copy`` (inputs copied to host and back) or
        ``recompute`` (its input is recomputed: in a level sweep's passes, ``sweep``, but for the run's first call,
        which copies the run's input; from another call's host copy: ``recompute_from``, or from the
        inputs of the calls in ``recomputed_inputs``)."""
        if self.recompute_from is not None or self.recomputed_inputs or (self.sweep and self.index != self.sweep[0]):
            return "recompute"
        return "copy" if self.offloaded else "keep"

    def __repr__(self) -> str:
        return f"PlanEntry({self.index}: {self.layer} [{self.layer_class}] {format_bytes(self.bytes)}, {self.reason})"


def tensor_bytes(shape: Sequence, dtype, batch_size: int = 1) -> int:
    """Bytes of a tensor; an unknown leading dimension counts as ``batch_size``, other unknowns as 1."""
    return _tensor_bytes(tuple(shape), getattr(dtype, "name", None) or str(dtype), batch_size)


@functools.lru_cache(maxsize=1 << 16)
def _tensor_bytes(shape: tuple, dtype: str, batch_size: int) -> int:
    """(cached: the planner's searches ask for the same few hundred tensors' sizes hundreds of thousands of
    times; the dtype lookup dominated a 3D U-Net's planning time)"""
    itemsize = np.dtype(_numpy_dtype(dtype)).itemsize
    n = 1
    for axis, dim in enumerate(shape):
        if dim is None:
            dim = batch_size if axis == 0 else 1
        n *= int(dim)
    return n * itemsize


def _numpy_dtype(dtype) -> str:
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.replace("torch.", "")
    return {"bfloat16": "float16", "bool": "bool_", "string": "object"}.get(name, name)


@dataclasses.dataclass
class RawCall:
    """A layer call seen by a planning trace, before any decision."""

    unit: object
    enclosing: list
    shapes: list
    dtypes: list
    ranks: list
    keys: list  # identity of each input tensor within the trace (for host-copy de-duplication)
    output_shapes: list
    output_dtypes: list
    offloadable: str | None
    output_keys: list = dataclasses.field(default_factory=list)  # identity of each output tensor (may be empty)
    # what the planner computed from this call and may ask again (``call_costs.call_cost``); never compared
    derived: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def derived_from_calls(calls, name: str, compute, *key, limit: int | None = None):
    """``compute()``, a fact of the whole traced call list, kept on its first call (``RawCall.derived``) under
    ``name``, the calls' identities and ``key``; the oldest of ``limit`` (default ``DERIVED_LISTS``) is dropped
    first. Why: the planner's searches ask for the same list's facts hundreds of thousands of times, and one pass
    over the list per question made planning quadratic in the calls (a concatenation's parts, asked per slab call
    per predicted step, were a third of DenseNet121's planning)."""
    cache = getattr(calls[0], "derived", None) if calls else None
    if cache is None:
        return compute()
    known = cache.setdefault(name, {})
    full = (tuple(map(id, calls)), *key)
    if full not in known:
        if len(known) >= (DERIVED_LISTS if limit is None else limit):
            known.pop(next(iter(known)))
        known[full] = compute()
    return known[full]


# Call lists whose facts are kept per name (the planner asks about one list, its tests about a few).
DERIVED_LISTS = 8


def call_graph(calls) -> tuple:
    """``(producers, consumers)`` of a traced forward pass: output key -> index of the call that makes it, and
    input key -> indices of the calls that read it (each once, in forward order)."""
    producers, consumers = {}, {}
    for i, call in enumerate(calls):
        for key in call.output_keys:
            producers[key] = i
        for key in set(call.keys):
            consumers.setdefault(key, []).append(i)
    return producers, consumers


@dataclasses.dataclass
class CallDecision:
    offload_tensor: list  # bool per input tensor
    reason: str
    slab_bytes: int | None = None  # the slab size the call is computed with (None: the config's)
    recompute_from: tuple | None = None  # (source call, call in between): PlanEntry.recompute_from
    sweep: tuple | None = None  # the call indices of its level sweep: PlanEntry.sweep
    sweep_windows: int | None = None  # PlanEntry.sweep_windows
    sweep_held: tuple = ()  # PlanEntry.sweep_held
    sweep_folded: tuple | None = None  # PlanEntry.sweep_folded
    folded_pooling: tuple | None = None  # PlanEntry.folded_pooling
    slab_align: int = 1  # PlanEntry.slab_align

    @property
    def offloaded(self) -> bool:
        return any(self.offload_tensor)


def plan_entries(calls: Sequence[RawCall], decisions: Sequence[CallDecision], facts, batch_size: int = 1,
                 slab_bytes: int = 0, lean_normalization: bool = True, min_bytes: int = 0) -> list:
    """One PlanEntry per call, in forward order, from the final decisions (``slab_bytes``, ``lean_normalization``,
    ``min_bytes``: the config's, for decisions that do not choose their own; ``facts``: the back end's
    ``BackendFacts``, whose ``host_bytes`` says what an offloaded call sends to host)."""
    entries, copied = [], set()
    for index, (call, decision) in enumerate(zip(calls, decisions)):
        sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        # Host copies that no backward reads are pruned by TensorFlow: count only what is read back.
        reads = facts.backward_reads(call.unit)[0]
        if decision.offloaded and not reads:
            decision = CallDecision(decision.offload_tensor,
                                    "offloaded: backward reads no inputs (output host copy or shapes only)",
                                    decision.slab_bytes)
        offloaded_bytes = sum(s for s, off in zip(sizes, decision.offload_tensor) if off) if reads else 0
        new_bytes = 0
        for key, size, off in zip(call.keys, sizes, decision.offload_tensor):
            if off and reads and key not in copied:
                copied.add(key)
                new_bytes += size
        if offloaded_bytes:
            sent = facts.host_bytes(call, offloaded_bytes, batch_size, lean_normalization, min_bytes)
            offloaded_bytes, new_bytes = sent, new_bytes * sent // offloaded_bytes
        entries.append(PlanEntry(
            index=index, layer=call.unit.name, layer_class=type(call.unit).__name__,
            shapes=[tuple(s) for s in call.shapes], dtypes=[str(d) for d in call.dtypes], bytes=sum(sizes),
            offloaded=decision.offloaded, reason=decision.reason, offloaded_bytes=offloaded_bytes,
            new_host_bytes=new_bytes, output_shapes=[tuple(s) for s in call.output_shapes],
            output_bytes=sum(tensor_bytes(s, d, batch_size) for s, d in zip(call.output_shapes, call.output_dtypes)),
            tensor_offloaded=list(decision.offload_tensor),
            slab_bytes=slab_bytes if decision.slab_bytes is None else decision.slab_bytes,
            unoffloadable=call.offloadable,
        ))
    return entries


def host_bytes_per_step(plan: Sequence[PlanEntry]) -> int:
    """Bytes held in host memory per step (each offloaded tensor once)."""
    return sum(e.new_host_bytes for e in plan)


def offloaded_keys(calls, decisions) -> set:
    """The keys of the tensors some call's decision (``CallDecision`` or ``PlanEntry``-like ``offload_tensor``)
    sends to host: a tensor with a host copy, which its other readers may read too."""
    return {key for call, d in zip(calls, decisions) for key, off in zip(call.keys, d.offload_tensor) if off}


def planned_prefetch(entries, default: int) -> int:
    """The prefetch depth a plan runs with: the planner's choice (``PlanEntry.prefetch``), else ``default``."""
    return next((e.prefetch for e in entries if e.prefetch is not None), default)


def planned_leads(entries, default: int):
    """How many calls ahead each call's copies back start: the plan's prefetch depth (``planned_prefetch``), or,
    where the planner started some copies earlier (``PlanEntry.copy_back_lead``), a tuple with one depth per call
    (what ``lead_of`` reads; the memory model and the step time accept either)."""
    depth = planned_prefetch(entries, default)
    if all(getattr(e, "copy_back_lead", None) is None for e in entries):
        return depth
    return tuple(depth if getattr(e, "copy_back_lead", None) is None else e.copy_back_lead for e in entries)


def lead_of(prefetch, reader: int) -> int:
    """The prefetch depth of ``reader``'s copies back: ``prefetch`` is one depth for every call, or one per call
    (``planned_leads``)."""
    return prefetch[reader] if isinstance(prefetch, tuple) else prefetch


def deepest_lead(prefetch) -> int:
    """The largest prefetch depth of ``prefetch`` (one depth, or one per call)."""
    return max(prefetch, default=0) if isinstance(prefetch, tuple) else prefetch


def planned_sweeps(entries) -> dict:
    """The level sweeps a plan runs: first call -> its setting (``sweep_setting``: the windows its passes cut
    the run into, ``PlanEntry.sweep_windows``, and with held units ``(windows, PlanEntry.sweep_held)``)."""
    return {e.sweep[0]: sweep_value(e.sweep_windows, getattr(e, "sweep_held", ()))
            for e in entries if getattr(e, "sweep", None) and e.index == e.sweep[0]}


def sweep_value(windows, held=()):
    """A sweep's setting in a ``swept`` mapping: the windows alone when nothing is held (what the searches that
    only choose windows pass), else ``(windows, held units)``; ``sweep_setting`` reads either."""
    return (windows, tuple(held)) if held else windows


def sweep_setting(value) -> tuple:
    """``(windows, held)`` of a sweep's setting in a ``swept`` mapping (``sweep_value``): the windows alone (None:
    the sweep's default), or ``(windows, held units)``."""
    return tuple(value) if isinstance(value, tuple) else (value, ())


def planned_short_chains(entries) -> frozenset:
    """The activations whose backward recomputes their output from their BatchNorm's input copy and takes its
    first pass there (short fused chains, ``PlanEntry.recompute_from == (BatchNorm, None)``)."""
    return frozenset(e.index for e in entries
                     if e.recompute_from is not None and e.recompute_from[1] is None)


def chosen_sweeps(facts, calls, offloaded, slabs: dict, swept) -> list:
    """The back end's sweeps (``BackendFacts.slab_sweeps``) that ``swept`` (first call -> setting, as
    ``planned_sweeps`` gives it) runs, each with its planned windows and held units."""
    if not swept or not slabs:
        return []
    chosen = []
    for s in facts.slab_sweeps(calls, offloaded, slabs):
        if s.first in swept:
            windows, held = sweep_setting(swept[s.first])
            allowed = set().union(*s.hold_options)  # a re-planned run (a call kept) may have fewer units
            chosen.append(dataclasses.replace(s, windows=windows or s.windows,
                                              held=tuple(j for j in held if j in allowed)))
    return chosen


def planned_slab_bytes(entries, default: int = 0) -> int:
    """The slab size a plan computes with: one size per plan (``budget.fit_budget``), read off its offloaded
    entries; ``default`` when nothing is offloaded."""
    return min((e.slab_bytes for e in entries if e.offloaded), default=default)
