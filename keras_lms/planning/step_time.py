"""How long a planned step takes on a device: compute, recompute and host-link copies, overlapped as they run.

The compute stream runs the forward calls, then their backward in reverse, each at the roofline of the device
profile (kernel FLOPs at the dtype's rate, memory-bound bytes at HBM bandwidth), plus what the plan makes it
recompute (``BackendFacts.recomputes_offloaded_output``, the halos of slab-computed calls and the windows of tensors
recomputed instead of copied, ``planning.recompute``). The host link has
one copy engine per direction (TensorFlow's device-to-host and host-to-device streams), or one for both where the
back end queues every copy on one stream (torch's copy stream: ``BackendFacts.shared_copy_stream``), each working
through its copies in the order they are issued, at the profile's solo rate, or at its concurrent rate while the
other direction is busy too:

- a copy out is issued when its forward call starts, and nothing waits for it (the device copy is freed later);
- a copy back is issued when its trigger's backward starts (``prefetch`` calls later in forward order, as the
  back ends schedule it) and the backward that reads it waits until it has arrived; a slab-computed call's
  windows arrive piece by piece, and each piece of its compute waits only for its own window;
- a copy back starts only once the copies out of what it reads have finished (``LinkTraffic.backward_after``):
  the last tensors the forward copies out are the first the backward reads, so a link slower than the forward
  delays the whole backward, and the two directions rarely overlap (measured on an H200: they never did).

What the compute stream spends waiting is the *exposed* copy time; the step is compute + recompute + exposed.
This is a model, not a measurement: no kernel launch overheads, no allocator stalls, the copy engines never
slowed by the compute's own HBM traffic. ``benchmarks/gpu_bench.py`` sets it beside measured steps.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import typing

from keras_lms.planning import layer_facts
from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.plan import lead_of
from keras_lms.planning.traffic import link_traffic


@dataclasses.dataclass
class StepTime:
    """Predicted time of one training step (seconds) and the work behind it.

    Attributes:
        compute_seconds: the step's forward and backward at their plain cost, without recompute or copies
            (a call the plan never runs, such as a concatenation a slab-computed reader elides, costs 0).
        recompute_seconds: what the plan adds to the compute stream (recomputed calls, slab halos, windows of
            tensors recomputed instead of copied: ``planning.recompute``).
        device_to_host_seconds / host_to_device_seconds: the copy engines' busy time.
        exposed_seconds: time the compute stream waits for copies back.
        step_seconds: compute + recompute + exposed.
        flops: kernel FLOPs the plain step runs; recompute_flops: the plan's extra kernel FLOPs.
        device_to_host_bytes / host_to_device_bytes: the plan's host-link traffic (``traffic.link_traffic``).
        call_waits: per call (forward order), the seconds the compute stream waits for its copies back, forward
            and backward together: where the exposed time is, which the report shows per row.
        call_recomputes: per call, the seconds of recompute its forward and backward add.
    """

    compute_seconds: float
    recompute_seconds: float
    device_to_host_seconds: float
    host_to_device_seconds: float
    exposed_seconds: float
    step_seconds: float
    flops: float
    recompute_flops: float
    device_to_host_bytes: int
    host_to_device_bytes: int
    call_waits: tuple = ()
    call_recomputes: tuple = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Link:
    """The host link's copy engines, FIFO each, with rates that drop when both directions copy at once.

    Two engines (host -> device, device -> host), or one that carries both directions in turn where the back end
    queues every copy on one stream (``BackendFacts.shared_copy_stream``: torch). A copy back waits for the
    copies out of what it reads (``after``): a host copy exists only once it has gone out, and a copy waiting at
    the head of its engine holds up the copies queued behind it, as a waiting stream does.
    """

    def __init__(self, profile, shared: bool = False):
        self.rate = {("in", False): profile.host_to_device_bytes_per_second,
                     ("in", True): profile.host_to_device_concurrent_bytes_per_second,
                     ("out", False): profile.device_to_host_bytes_per_second,
                     ("out", True): profile.device_to_host_concurrent_bytes_per_second}
        self.shared = shared
        self.queues = {"both": collections.deque()} if shared else {"in": collections.deque(),
                                                                     "out": collections.deque()}
        self.busy = {"in": 0.0, "out": 0.0}
        self.done = {}
        self.now = 0.0

    def issue(self, direction: str, nbytes: float, ident, after=()) -> None:
        if nbytes <= 0:
            self.done[ident] = self.now
            return
        self.queues["both" if self.shared else direction].append([float(nbytes), ident, direction, tuple(after)])

    def _step(self, until: float) -> bool:
        """Advance to the next completion or to ``until``; False when no copy can make progress."""
        heads = [q[0] for q in self.queues.values() if q]
        running = [h for h in heads if all(a in self.done for a in h[3])]
        if not running:
            if heads and math.isinf(until):
                return False  # waiting for a copy that was never issued
            self.now = max(self.now, until)
            return False
        both = len({h[2] for h in running}) == 2
        rates = [self.rate[(h[2], both)] for h in running]
        dt = min(min(h[0] / r for h, r in zip(running, rates)), until - self.now)
        for head, rate in zip(running, rates):
            head[0] -= rate * dt
            self.busy[head[2]] += dt
            if head[0] <= 1.0:  # within a byte: done (float rounding)
                self.queues["both" if self.shared else head[2]].popleft()
                self.done[head[1]] = self.now + dt
        self.now += dt
        return True

    def advance_to(self, t: float) -> None:
        while self.now < t and self._step(t):
            pass

    def completion(self, ident) -> float:
        while ident not in self.done:
            if not self._step(math.inf):
                raise RuntimeError(f"copy {ident!r} was never issued, or waits for one that was not")  # a bug
        return self.done[ident]


def _compute_seconds(cost, profile, flops_factor: float, backward: bool) -> float:
    if backward:
        return (cost.backward_flops * flops_factor / profile.flops_rate(cost.dtype, cost.channels)
                + cost.backward_bytes / profile.elementwise_bytes_per_second
                + cost.backward_layout_bytes / profile.layout_copy_rate())
    return (cost.forward_flops * flops_factor / profile.flops_rate(cost.dtype, cost.channels)
            + cost.forward_bytes / profile.elementwise_bytes_per_second
            + cost.forward_layout_bytes / profile.layout_copy_rate())


class StepWork(typing.NamedTuple):
    """What a plan's step computes and moves, whatever its prefetch depths: ``step_work`` once, for a search that
    times one plan at many depths (``copy_back_leads``: half of each timing was this)."""

    costs: list
    traffic: object
    slabs: dict
    elided: dict


def step_work(calls, offloaded, facts, batch_size: int = 1, slab_bytes: int = 0, recomputed=frozenset(),
              swept=None, short_chains=frozenset()) -> StepWork:
    """The per-call costs, host-link traffic, slabs and elided concatenations of a plan (see ``StepWork``)."""
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes) if calls else {}
    return StepWork([call_cost(call, batch_size, facts) for call in calls],
                    link_traffic(calls, offloaded, facts, batch_size, slab_bytes, recomputed, swept, short_chains),
                    slabs, facts.elided_concatenations(calls, slabs, batch_size) if slabs else {})


def predict_step_time(calls, offloaded, facts, profile, batch_size: int = 1, prefetch: int = 1,
                      slab_bytes: int = 0, lean_normalization: bool = True, recomputed=frozenset(),
                      swept=None, short_chains=frozenset(), work: StepWork | None = None) -> StepTime:
    """The predicted step time of a plan (``offloaded[i][j]``: input j of call i goes to host; ``recomputed``:
    the calls whose outputs are recomputed instead of copied; ``swept``: the level sweeps it runs, first call ->
    windows, ``plan.planned_sweeps``; ``short_chains``: ``plan.planned_short_chains``) on ``profile`` (a
    ``DeviceProfile``); with no input offloaded it is the plain step. ``work``: ``step_work`` of the same plan,
    computed once by the caller. See the module docstring."""
    n = len(calls)
    if work is None:
        work = step_work(calls, offloaded, facts, batch_size, slab_bytes, recomputed, swept, short_chains)
    costs, traffic, slabs, elided = work

    def window_recompute(flops_and_bytes, dtype):
        flops, nbytes = flops_and_bytes
        return flops / profile.flops_rate(dtype) + nbytes / profile.elementwise_bytes_per_second, flops

    link = _Link(profile, facts.shared_copy_stream)
    plain = recompute = flops = extra_flops = 0.0
    waits, redone = [0.0] * n, [0.0] * n
    pending = {}  # call index -> its backward's copy-back pieces, once issued

    def issue_backward(i):
        k = traffic.backward_pieces[i]
        pending[i] = [("bwd", i, j) for j in range(k)]
        after = [("out", j) for j in traffic.backward_after[i]]
        for ident in pending[i]:
            link.issue("in", traffic.backward_in_bytes[i] / k, ident, after)

    triggered = {}
    for c in range(n):
        lead = lead_of(prefetch, c)
        triggered.setdefault(c if lead <= 0 else min(c + lead, n - 1), []).append(c)
    t = 0.0
    for i in range(n):  # forward
        link.advance_to(t)
        link.issue("out", traffic.out_bytes[i], ("out", i))
        cost = costs[i]
        factor = facts.slab_flop_factors(calls[i].unit, slabs[i])[0] if i in slabs else 1.0
        base = 0.0 if i in elided else _compute_seconds(cost, profile, 1.0, backward=False)
        run = 0.0 if i in elided else _compute_seconds(cost, profile, factor, backward=False)
        redo, redo_flops = window_recompute(traffic.forward_recompute[i], cost.dtype)
        run += redo
        plain, recompute = plain + base, recompute + run - base
        redone[i] += run - base
        flops += cost.forward_flops
        extra_flops += (cost.forward_flops * (factor - 1) if i not in elided else 0.0) + redo_flops
        k = traffic.backward_pieces[i] if traffic.forward_in_bytes[i] else 1
        after = [("out", j) for j in traffic.forward_after[i]]
        for j in range(k):
            link.issue("in", traffic.forward_in_bytes[i] / k, ("fwd", i, j), after)
        for j in range(k):
            waits[i] += max(0.0, link.completion(("fwd", i, j)) - t)
            t = max(t, link.completion(("fwd", i, j)))
            link.advance_to(t)
            t += run / k
    for i in range(n - 1, -1, -1):  # backward
        link.advance_to(t)
        # copies back that this backward's start triggers (prefetch), the soonest needed first (as torch's
        # ``swap_in_order`` issues them; the first backward triggers the last ``prefetch`` + 1 calls' at once)
        for c in sorted(triggered.get(i, ()), reverse=True):
            if c not in pending:
                issue_backward(c)
        cost, unit = costs[i], calls[i].unit
        factor = facts.slab_flop_factors(unit, slabs[i])[1] if i in slabs else 1.0
        base = 0.0 if i in elided else _compute_seconds(cost, profile, 1.0, backward=True)
        run = 0.0 if i in elided else _compute_seconds(cost, profile, factor, backward=True)
        flops += cost.backward_flops
        extra = cost.backward_flops * (factor - 1) if i not in elided else 0.0
        # (a level sweep's calls run no forward again in their own backward: its passes recompute, as traffic counts)
        if any(offloaded[i]) and i not in elided and i not in traffic.swept_calls:
            redo = _recompute_seconds(cost, calls[i], facts, profile, lean_normalization)
            run += redo
            extra += cost.forward_flops if redo and cost.forward_flops else 0.0
        redo, redo_flops = window_recompute(traffic.backward_recompute[i], cost.dtype)
        run, extra = run + redo, extra + redo_flops
        plain, recompute, extra_flops = plain + base, recompute + run - base, extra_flops + extra
        redone[i] += run - base
        pieces = pending[i]
        for ident in pieces:
            waits[i] += max(0.0, link.completion(ident) - t)
            t = max(t, link.completion(ident))
            link.advance_to(t)
            t += run / len(pieces)
    link.advance_to(math.inf)
    exposed = max(0.0, t - plain - recompute)
    return StepTime(plain, recompute, link.busy["out"], link.busy["in"], exposed, t, flops, extra_flops,
                    traffic.device_to_host_bytes, traffic.host_to_device_bytes, tuple(waits), tuple(redone))


def recomputes_forward(call, facts, lean_normalization: bool = True) -> bool:
    """Whether an offloaded call's backward runs its forward again (what the step time charges, and what the
    report calls ``copy+recompute``): not for structural calls, output-differentiated activations, kernels whose
    recompute the back end prunes (TensorFlow) or does without (torch's lean convolution), or lean normalisation."""
    unit = call.unit
    if facts.keeps_no_activation(unit) or facts.output_gradient_activation(unit) is not None:
        return False  # structural, or differentiated from its output: nothing to recompute
    if layer_facts.is_keras_class(unit, layer_facts.KERNEL_LAYERS):
        return facts.recomputes_offloaded_output(unit) and not facts.lean_convolution_call(unit)
    return not (lean_normalization and facts.lean_normalization_call(unit, call.dtypes))


def _recompute_seconds(cost, call, facts, profile, lean_normalization: bool) -> float:
    """Compute an offloaded call's backward adds: its forward again where the back end recomputes it."""
    if not recomputes_forward(call, facts, lean_normalization):
        return 0.0
    if layer_facts.is_keras_class(call.unit, layer_facts.KERNEL_LAYERS):
        return (cost.forward_flops / profile.flops_rate(cost.dtype, cost.channels)
                + cost.forward_layout_bytes / profile.layout_copy_rate())
    return cost.forward_bytes / profile.elementwise_bytes_per_second
