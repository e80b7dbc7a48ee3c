"""What the budget planner's searches ask of a plan: its predicted step time and device memory, with one of its
settings (offload decisions, prefetch depth, recomputed tensors, sweeps, short chains) replaced by a trial value
and the rest of the plan as it is. Why a module of its own: every search in ``budget`` (and the edge plan) asks
these two questions hundreds of times, the same way.
"""

from __future__ import annotations

from keras_lms.planning.memory_model import simulate
from keras_lms.planning.plan import planned_leads, planned_short_chains, planned_slab_bytes, planned_sweeps
from keras_lms.planning.recompute import recomputed_producers
from keras_lms.planning.step_time import predict_step_time, step_work


def plan_seconds(calls, entries, config, facts, batch_size: int, offloaded=None, prefetch=None,
                 recomputed=None, short_chains=None) -> float:
    """The predicted step of the plan of ``entries`` on ``config.device_profile``, with the given offload
    decisions, prefetch depth or recomputed tensors in place of the plan's (the rest of the plan as it is; the
    time-side twin of ``fits_budget``)."""
    return plan_time(calls, entries, config, facts, batch_size, offloaded, prefetch, recomputed,
                     short_chains).step_seconds


def plan_time(calls, entries, config, facts, batch_size: int, offloaded=None, prefetch=None, recomputed=None,
              short_chains=None, work=None):
    """``plan_seconds``'s ``StepTime`` (where the step waits, per call: ``copy_back_leads``); ``work``: the plan's
    ``plan_work``, for a search that changes only the prefetch depths."""
    rows = [list(e.tensor_offloaded) for e in entries] if offloaded is None else offloaded
    return predict_step_time(calls, rows, facts, config.device_profile, batch_size,
                             planned_leads(entries, config.prefetch) if prefetch is None else prefetch,
                             planned_slab_bytes(entries), config.lean_normalization,
                             recomputed_producers(entries) if recomputed is None else recomputed,
                             planned_sweeps(entries),
                             planned_short_chains(entries) if short_chains is None else short_chains, work)


def plan_work(calls, entries, facts, batch_size: int):
    """The plan's ``step_time.StepWork``: what its step computes and moves, at any prefetch depth."""
    return step_work(calls, [list(e.tensor_offloaded) for e in entries], facts, batch_size,
                     planned_slab_bytes(entries), recomputed_producers(entries), planned_sweeps(entries),
                     planned_short_chains(entries))


def fits_budget(calls, entries, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                prefetch=None, recomputed=None, swept=None, offloaded=None, short_chains=None) -> bool:
    """Whether the plan of ``entries`` fits ``device_budget`` by the memory model with the planner's margin, with
    the given prefetch depth, recomputed tensors, sweeps (first call -> windows) or offload decisions in place of
    the plan's (``config.prefetch``, ``PlanEntry.recomputed_output``, ``PlanEntry.sweep``,
    ``PlanEntry.tensor_offloaded``)."""
    memory = plan_memory(calls, entries, config, facts, batch_size, static_bytes, update_bytes, prefetch,
                         recomputed, swept, offloaded, short_chains)
    return memory.budget_bytes <= config.device_budget


def plan_memory(calls, entries, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                prefetch=None, recomputed=None, swept=None, offloaded=None, short_chains=None):
    """The memory model's ``StepMemory`` of the plan of ``entries`` (what ``fits_budget`` compares)."""
    if offloaded is None:
        offloaded = [list(e.tensor_offloaded) for e in entries]
    return simulate(calls, offloaded, facts, batch_size, config.prefetch if prefetch is None else prefetch,
                    static_bytes, update_bytes=update_bytes, lean_normalization=config.lean_normalization,
                    slab_bytes=planned_slab_bytes(entries),
                    recomputed=recomputed_producers(entries) if recomputed is None else recomputed,
                    swept=planned_sweeps(entries) if swept is None else swept,
                    short_chains=planned_short_chains(entries) if short_chains is None else short_chains)
