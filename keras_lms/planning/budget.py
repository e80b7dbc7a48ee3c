"""The budget planner: the per-call rules, narrowed to what ``device_budget`` needs.

Choice: largest and longest-lived tensors first (bytes x distance to their backward use), the last layers
stay resident (``keep_last``), until the predicted peak (with ``BUDGET_MARGIN``) fits; nothing is offloaded when
the step fits anyway; when even full offload cannot fit, smaller slabs are tried where the back end computes
calls in slabs, and then the error names the largest single layer call. With a device profile
(``LMSConfig.device_profile``) the slab size is then chosen for time: among the sizes that fit (the configured
one, its halvings and doublings), the one whose predicted step (``step_time``) is shortest, since larger slabs
recompute fewer halos and bring fewer window rows back.
"""

from __future__ import annotations

import dataclasses
import logging

from keras_lms.config import format_bytes
from keras_lms.planning import rules, sweep_plan
from keras_lms.planning.budget_fit import BudgetError, fit_budget
from keras_lms.planning.chain_plan import TWICE_NOTE, note_short_chain, plan_short_chains
from keras_lms.planning.keep_plan import calls_to_keep, keep_decisions, keep_unread_activation_outputs
from keras_lms.planning.memory_model import BUDGET_MARGIN
from keras_lms.planning.plan import (
    plan_entries,
    planned_prefetch,
    planned_short_chains,
    planned_slab_bytes,
    tensor_bytes,
)
from keras_lms.planning.plan_measures import fits_budget, plan_memory, plan_seconds
from keras_lms.planning.prefetch_plan import plan_prefetch
from keras_lms.planning.recompute import choose_recomputed, recomputed_producers
from keras_lms.planning.source_offload import offload_sources
from keras_lms.planning.sweep_plan import note_swept_host_bytes, plan_sweep_windows, plan_sweeps, refine_sweeps

log = logging.getLogger(__name__)

__all__ = ["BudgetError", "build_plan", "fit_budget"]


def build_plan(calls, config, facts, batch_size: int = 1, static_bytes: int = 0, update_bytes: int = 0) -> list:
    """Decide every call of one forward pass: the policy's per-call rules, narrowed to what ``device_budget``
    needs (``static_bytes`` of weights, gradients and optimizer state and the optimizer update's
    ``update_bytes`` included in the predicted step). One ``PlanEntry`` per call, in forward order. ``facts`` is
    the back end's ``BackendFacts``. Where the budget is met only without the planner's margin (the largest
    volumes), ``_plan_at_the_edge``.
    """
    decisions = rules.decide_all(calls, config, batch_size)
    if config.device_budget is None:
        return _finish_plan(calls, decisions, config, facts, batch_size, static_bytes, update_bytes)
    try:
        return _budget_plan(calls, decisions, config, facts, batch_size, static_bytes, update_bytes)
    except BudgetError as error:
        return _plan_at_the_edge(calls, decisions, config, facts, batch_size, static_bytes, update_bytes, error)


def _budget_plan(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int) -> list:
    """The plan that fits ``config.device_budget`` with the margin. With a device profile, two plans are finished
    and the faster kept: from the fewest offloads that fit (bytes x distance first) and from every eligible
    tensor offloaded. Why both: a plan with room left copies what it offloads, while one that offloads
    everything computes in windows and recomputes cheaply what the other copies; which is faster depends on the
    room and the link (on H100-PCIe5 the 384^3 float32 3D U-Net at 40 GiB: 4.1x the plain step from the fewest
    offloads, 1.7x from all), and choosing one alone made a larger budget give a much slower plan (the first is
    kept where they tie). Each is finished at its slab size and at the sizes that tie with it
    (``_finish_ties``)."""
    fewest = fit_budget(calls, decisions, config, facts, batch_size, static_bytes, update_bytes)
    plan = _finish_ties(calls, fewest, config, facts, batch_size, static_bytes, update_bytes)
    if (config.device_profile is None or not any(f.offloaded for f in fewest.decisions)  # (the step fits as it is)
            or all(list(f.offload_tensor) == list(d.offload_tensor)
                   for f, d in zip(fewest.decisions, decisions) if d.offloaded)):
        return plan  # (every eligible tensor is offloaded already: the same start)
    every = fit_budget(calls, decisions, config, facts, batch_size, static_bytes, update_bytes, offload_all=True)
    other = _finish_ties(calls, every, config, facts, batch_size, static_bytes, update_bytes)
    return _faster(calls, plan, other, config, facts, batch_size,
                   "from every eligible tensor offloaded, not the fewest offloads that fit")


def _finish_ties(calls, start, config, facts, batch_size: int, static_bytes: int, update_bytes: int) -> list:
    """A budget start (``budget_fit.BudgetStart``) finished at its slab size, or at a size whose corner step ties
    with it (``slab_choice.SLAB_TIE``) where that plan is predicted faster before the budget's leftover room is
    used (``_plan_decisions``: sweeps, recomputed tensors, prefetch and short chains chosen; ``_use_room``, the
    keep search, runs for the chosen size only). Why: the corner ranks slab sizes before those choices, which
    differ by size (400^3 float32 on GH200: corners 0.412 s at 1 GiB and 0.416 s at 512 MiB, finished 0.383
    and 0.379 s)."""
    sizes = {d.slab_bytes for d in start.decisions if d.slab_bytes is not None}
    settings = (config, facts, batch_size, static_bytes, update_bytes)
    if start.tied_slab_bytes and config.device_profile is not None and len(sizes) == 1:
        planned = {size: _first_plan(calls, start.at_slab_bytes(size), *settings)
                   for size in (sizes.pop(), *start.tied_slab_bytes)}  # (the corner's choice first: wins ties)
        corner, *_ = planned
        best = min(planned, key=lambda size: plan_seconds(calls, planned[size][1], config, facts, batch_size))
        plan = _finish_plan(calls, start.decisions, *settings, planned=planned[corner])
        if best == corner:
            return plan
        other = _finish_plan(calls, start.at_slab_bytes(best), *settings, planned=planned[best])
        return _faster(calls, plan, other, config, facts, batch_size,
                       f"in slabs of {format_bytes(best)}, whose step ties at the corner")
    return _finish_plan(calls, start.decisions, *settings)


def _faster(calls, first, second, config, facts, batch_size: int, how: str) -> list:
    """``first``, or ``second`` where its predicted step is shorter (a tie keeps ``first``), logged as ``how``."""
    seconds = [plan_seconds(calls, p, config, facts, batch_size) for p in (first, second)]
    if seconds[1] >= seconds[0]:
        return first
    log.info("keras-lms: planned %s (predicted step %.3f s instead of %.3f s on %s).", how, seconds[1], seconds[0],
             config.device_profile.name)
    return second


def _plan_at_the_edge(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                      error: BudgetError) -> list:
    """The plan where the budget planner's starts (``fit_budget``) refused ``device_budget``: wrap's defaults (no
    budget: every eligible tensor offloaded, finished with level sweeps and recomputed tensors), which may fit
    where those starts, simulated before any sweep, did not. Where they fit with the planner's margin, finished
    for the budget (``_finish_at_the_edge``); where only without it, as they are with a warning; else ``error``.

    Why: at the largest volumes the starts refused a budget that the plan ``wrap`` makes without one runs in (the
    3D U-Net's default plans at 400^3 float32 and 496^3 mixed_float16 on H100-PCIe5 are predicted at 12.1 and
    12.0 GiB, their starts at more than 16). A user who named the GPU's memory got a BudgetError for a volume
    that trains without the budget. Where only the defaults fit without the margin, a plan predicted as small
    as them but faster peaked 5% over its prediction in the executed graph (docs/design.md, "A budget the starts
    refuse")."""
    defaults = _finish_plan(calls, decisions, dataclasses.replace(config, device_budget=None), facts, batch_size,
                            static_bytes, update_bytes)
    memory = plan_memory(calls, defaults, config, facts, batch_size, static_bytes, update_bytes)
    if memory.budget_bytes <= config.device_budget:
        log.info("keras-lms: device_budget %s: planned from wrap's plan without a budget (predicted %s; every "
                 "eligible tensor offloaded was predicted not to fit before the level sweeps).",
                 format_bytes(config.device_budget), format_bytes(memory.peak_bytes))
        return _finish_at_the_edge(calls, decisions, defaults, config, facts, batch_size, static_bytes, update_bytes)
    if memory.peak_bytes > config.device_budget:
        raise error
    log.warning("keras-lms: device_budget %s is met only without the planner's %d%% margin (predicted %s with every "
                "eligible tensor offloaded): planned as wrap plans without a budget. If the step runs out of device "
                "memory, use a smaller input or batch.", format_bytes(config.device_budget),
                round((BUDGET_MARGIN - 1) * 100), format_bytes(memory.peak_bytes))
    for entry in defaults:
        if entry.offloaded:
            entry.reason += (f"; device_budget {format_bytes(config.device_budget)} is met only without the "
                             f"planner's margin (predicted {format_bytes(memory.peak_bytes)}): wrap's defaults")
    return defaults


# Whether a plan at the edge (``_finish_at_the_edge``) is finished for the budget: off, the defaults as they are
# (the control of tests/offload/tensorflow/test_edge_budget.py).
FINISH_AT_THE_EDGE = True
# Whether that finish also sweeps runs the defaults did not (``sweep_plan.plan_sweep_windows(unswept=True)``); off:
# the control of tests/offload/tensorflow/test_edge_budget.py.
SWEEP_UNSWEPT_AT_THE_EDGE = True


def _finish_at_the_edge(calls, decisions, defaults, config, facts, batch_size: int, static_bytes: int,
                        update_bytes: int) -> list:
    """The defaults' decisions (every eligible tensor offloaded) planned for the budget, where the defaults fit it
    with the margin: sweep windows, prefetch depth and short chains chosen by the budget, then small inputs
    offloaded and sweep units held where it has room (``_use_room`` without the keep search); the faster of that
    and the defaults. Why not the keep search: grappler's own estimate of the step, which decides whether its
    memory optimizer swaps by itself, peaks at the top of the backward at these volumes, where it counts four
    level-0 tensors at once (the last ReLU's output and gradient, the head's input gradient, and that gradient's
    slab pieces or the ReLU gradient's layout fence: 4 x 3.8 GiB at 400^3, 15.50 GiB for the defaults where the
    executed timeline holds about 11.4), and every call kept on the device is live there too. Finished with
    keeps, the 400^3 float32 plan (predicted 2.41x the plain step, executed 15.03 GiB) made grappler estimate
    17.79 GiB and swap 35 GiB each way on a 16 GiB GPU (496^3 mixed_float16: 17.60, 28 GiB). Held units and
    thicker windows live later in the backward, and grappler's estimate stays the defaults' (docs/design.md, "A
    budget the starts refuse"). Runs the defaults do not sweep are offered too (``SWEEP_UNSWEPT_AT_THE_EDGE``):
    the level-0 decoder, whose default windows are slower than recomputing its tensors per reader but whose
    thicker ones are faster (400^3 float32: 2.52x -> 2.40x the plain step; grappler's estimate 15.50 -> 15.32
    GiB, no swaps on a 16 GiB GPU). Not where the keep search runs: there grappler's estimate exceeds the GPU
    and it swapped that sweep's output gradient once per window (docs/design.md, "Held convolution outputs in
    sweeps")."""
    if not FINISH_AT_THE_EDGE or config.device_profile is None:
        return defaults
    finished = _finish_plan(calls, decisions, config, facts, batch_size, static_bytes, update_bytes, keep=False,
                            unswept=SWEEP_UNSWEPT_AT_THE_EDGE)
    if not fits_budget(calls, finished, config, facts, batch_size, static_bytes, update_bytes,
                       prefetch=planned_prefetch(finished, config.prefetch)):
        return defaults
    return _faster(calls, defaults, finished, config, facts, batch_size,
                   "for device_budget from wrap's plan without a budget, nothing more kept on the device")


def _first_plan(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int) -> tuple:
    """``(decisions, entries)``: the decisions with unread activation outputs kept, planned as far as
    ``_plan_decisions`` goes (what ``_finish_plan`` starts from, before the budget's leftover room is used)."""
    decisions = keep_unread_activation_outputs(calls, decisions, facts)
    return decisions, _plan_decisions(calls, decisions, config, facts, batch_size, static_bytes, update_bytes)


def _finish_plan(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                 keep: bool = True, unswept: bool = False, planned: tuple | None = None) -> list:
    """The plan's entries from the offload decisions: slabs, sweeps, recomputed tensors, prefetch and, with a
    budget and a profile, the budget's leftover room used (``_use_room``) with the keep search and without it, the
    faster kept (``keep=False``: without it only, and ``unswept``: the hold pass also offered the runs not swept,
    both for ``_finish_at_the_edge``). Why both: the searches are greedy, and
    calls kept first take room that held sweep units use better (448^3 mixed_float16 at 20 GiB: 0.438 s with the
    keep search, 0.418 s without). ``planned``: ``_first_plan`` of these decisions, where the caller made it."""
    decisions, entries = planned or _first_plan(calls, decisions, config, facts, batch_size, static_bytes,
                                                update_bytes)
    if config.device_profile is None or config.device_budget is None:
        return entries
    settings = (config, facts, batch_size, static_bytes, update_bytes)
    keep = keep and facts.room_for_keeps(calls, batch_size, config.device_budget)  # (grappler's own swaps)
    kept, searched = _use_room(calls, decisions, entries, *settings, keep=keep, unswept=unswept)
    if not searched:
        return kept
    # (the keep search re-planned a copy)
    unkept, _ = _use_room(calls, decisions, entries, *settings, keep=False, unswept=unswept)
    return _faster(calls, kept, unkept, config, facts, batch_size, "without keeping offloaded calls on the device")


def _use_room(calls, decisions, entries, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
              keep: bool, unswept: bool = False) -> tuple:
    """``(entries, whether the keep search kept a call)``: the budget's leftover room used by, in turn, the calls
    kept where it has room (``_keep_where_room``, with ``keep``), small inputs offloaded (``_offload_sources``)
    and the sweep units held on the device (``sweep_plan.plan_sweep_windows``, last: earlier they took room that
    kept calls use better, docs/design.md, "Held convolution outputs in sweeps")."""
    searched = False
    for _ in range(KEEP_ROUNDS if keep else 0):
        decisions, entries, kept = _keep_where_room(calls, decisions, entries, config, facts, batch_size,
                                                    static_bytes, update_bytes)
        searched = searched or kept
        if not kept:
            break
    decisions, entries = _offload_sources(calls, decisions, entries, config, facts, batch_size, static_bytes,
                                          update_bytes)
    ahead = planned_prefetch(entries, config.prefetch)  # (the plan's prefetch depth holds copies back longer)
    plan_sweep_windows(calls, entries, config, facts, batch_size,
                       lambda swept: fits_budget(calls, entries, config, facts, batch_size, static_bytes,
                                                 update_bytes, prefetch=ahead, swept=swept), unswept=unswept)
    note_swept_host_bytes(entries)  # (a run swept only now copies nothing inside it either)
    return entries, searched


def _plan_decisions(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                    recomputed=frozenset()) -> list:
    """The plan's entries from the per-call offload decisions: slabs, level sweeps and, with a device profile,
    the recomputed tensors (a search that starts from ``recomputed``), the sweeps' windows and the prefetch
    depth."""
    entries = plan_entries(calls, decisions, facts, batch_size, config.slab_bytes, config.lean_normalization,
                           config.min_bytes)
    entries = _note_slabs(calls, entries, facts, batch_size)
    offloaded_rows = [list(e.tensor_offloaded) for e in entries]
    for i, positions in facts.parked_inputs(calls, offloaded_rows, batch_size, planned_slab_bytes(entries)).items():
        entries[i].parked_inputs = sorted(positions)
        entries[i].reason += "; parked on host after this call for a far reader, which reads it from there"
    plan_sweeps(calls, entries, config, facts, batch_size)
    if config.device_profile is not None:
        _plan_recompute(calls, entries, config, facts, batch_size, static_bytes, update_bytes, recomputed)
        refine_sweeps(calls, entries, config, facts, batch_size)
        if config.device_budget is not None:
            plan_sweep_windows(calls, entries, config, facts, batch_size,
                               lambda swept: fits_budget(calls, entries, config, facts, batch_size, static_bytes,
                                                         update_bytes, swept=swept), holds=False)
            plan_prefetch(calls, entries, config, facts, batch_size, static_bytes, update_bytes)
            ahead = planned_prefetch(entries, config.prefetch)
            plan_short_chains(calls, entries, facts, batch_size,
                              lambda short: plan_seconds(calls, entries, config, facts, batch_size,
                                                         short_chains=short),
                              lambda short: fits_budget(calls, entries, config, facts, batch_size, static_bytes,
                                                        update_bytes, prefetch=ahead, short_chains=short))
    note_swept_host_bytes(entries)
    return entries


def _offload_sources(calls, decisions, entries, config, facts, batch_size: int, static_bytes: int,
                     update_bytes: int) -> tuple:
    """``(decisions, entries)`` with the small inputs offloaded that ``source_offload`` finds worth it."""
    def try_plan(trial):
        planned = _plan_decisions(calls, trial, config, facts, batch_size, static_bytes, update_bytes,
                                  recomputed_producers(entries))
        if fits_budget(calls, planned, config, facts, batch_size, static_bytes, update_bytes,
                       prefetch=planned_prefetch(planned, config.prefetch)):  # (else None: it does not fit)
            return plan_seconds(calls, planned, config, facts, batch_size), planned

    decisions, planned, _ = offload_sources(calls, decisions, config, batch_size, try_plan,
                                            plan_seconds(calls, entries, config, facts, batch_size))
    return decisions, planned or entries


# Rounds of the keep search: a re-planned plan (other sweeps, recomputed tensors, prefetch) may leave room for more.
KEEP_ROUNDS = 2


def _keep_where_room(calls, decisions, entries, config, facts, batch_size: int, static_bytes: int,
                     update_bytes: int) -> tuple:
    """``(decisions, entries, whether any call was kept)``: the plan with the offloaded calls
    ``keep_plan.calls_to_keep`` picks kept on the device, re-planned (sweeps, recomputed tensors, prefetch) for
    the new decisions, where that finished plan fits the budget and is predicted faster than ``entries``; the
    plan as it was otherwise."""
    offloaded = [list(e.tensor_offloaded) for e in entries]
    prefetch = planned_prefetch(entries, config.prefetch)

    def seconds(rows):
        return plan_seconds(calls, entries, config, facts, batch_size, rows)

    def fits(rows):
        return fits_budget(calls, entries, config, facts, batch_size, static_bytes, update_bytes,
                           prefetch=prefetch, offloaded=rows)

    copying = {i for i, call in enumerate(calls) if any(offloaded[i]) and facts.backward_reads(call.unit)[0]}
    saved = calls_to_keep(offloaded, seconds, fits, copying)
    if not saved:
        return decisions, entries, False
    kept = keep_unread_activation_outputs(calls, keep_decisions(decisions, saved, config.device_profile.name), facts)
    # (the re-plan's recompute search starts from the plan's: the kept calls may fit only with those tensors
    # recomputed, and a search that starts from none would find no first step that fits)
    replanned = _plan_decisions(calls, kept, config, facts, batch_size, static_bytes, update_bytes,
                                recomputed_producers(entries))
    before, after = seconds(offloaded), plan_seconds(calls, replanned, config, facts, batch_size)
    if after >= before or not fits_budget(calls, replanned, config, facts, batch_size, static_bytes, update_bytes,
                                          prefetch=planned_prefetch(replanned, config.prefetch)):
        return decisions, entries, False
    log.info("keras-lms: keeping %d offloaded layer calls on the device where device_budget has room (predicted "
             "step %.3f s instead of %.3f s on %s).", len(saved), after, before, config.device_profile.name)
    return kept, replanned, True


def _plan_recompute(calls, entries, config, facts, batch_size: int, static_bytes: int = 0,
                    update_bytes: int = 0, start=frozenset()) -> None:
    """Mark the tensors to recompute instead of copying (``planning.recompute``), chosen by the predicted step
    on ``config.device_profile`` (a search that starts from ``start``), and say so in the entries' reasons."""
    offloaded = [list(e.tensor_offloaded) for e in entries]
    slab_bytes = planned_slab_bytes(entries)
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes)
    chains = facts.fused_slab_chains(calls, offloaded, slabs, planned_short_chains(entries)) if slabs else {}
    candidates = {s.producer: s for s in facts.recompute_sources(calls, offloaded, slabs, chains, batch_size).values()
                  if s.chosen}
    if not candidates:
        return

    def seconds(recomputed):
        return plan_seconds(calls, entries, config, facts, batch_size, recomputed=recomputed)

    fits = None
    if config.device_budget is not None:
        def fits(recomputed):  # a whole recompute holds its source's copy back longer (memory_model)
            return fits_budget(calls, entries, config, facts, batch_size, static_bytes, update_bytes,
                               recomputed=recomputed)

    chosen = choose_recomputed(candidates, seconds, fits, start)
    if not chosen:
        return
    log.info("keras-lms: recomputing %d tensors instead of copying them (predicted step %.3f s on %s).",
             len(chosen), seconds(chosen), config.device_profile.name)
    by_key = {candidates[p].key: p for p in chosen}
    recounted = {}  # recomputed key -> the first entry that counted it as new host bytes
    for p in sorted(chosen):
        source = candidates[p]
        entries[p].recomputed_output = True
        if source.length > 1:
            how = "every backward that reads it recomputes its windows from this call's inputs"
        else:  # recomputed whole (torch), from the copy of another call's input
            names = ", ".join(calls[q].unit.name for q in range(len(calls)) if set(calls[q].output_keys)
                              & {k for k, _ in source.inputs})
            how = f"the backward that reads it recomputes it from the host copy of {names}'s output"
        entries[p].reason += (f"; its output is not copied: {how} (cheaper than the host link on "
                              f"{config.device_profile.name})")
    for i, call in enumerate(calls):
        producers = [by_key[k] for k in call.keys if k in by_key]
        if not producers or not entries[i].offloaded:
            continue
        entries[i].recomputed_inputs = sorted(set(producers))
        names = ", ".join(calls[p].unit.name for p in entries[i].recomputed_inputs)
        windows = " in windows" if any(candidates[p].length > 1 for p in entries[i].recomputed_inputs) else ""
        entries[i].reason += f"; its input from {names} is recomputed{windows}, not copied"
        for key, shape, dtype, off in zip(call.keys, call.shapes, call.dtypes, entries[i].tensor_offloaded):
            if off and key in by_key:  # no host copy of it (host memory: only what is copied)
                size = tensor_bytes(shape, dtype, batch_size)
                entries[i].offloaded_bytes = max(0, entries[i].offloaded_bytes - size)
                if recounted.setdefault(key, i) == i:
                    entries[i].new_host_bytes = max(0, entries[i].new_host_bytes - size)


def _note_slabs(calls, entries, facts, batch_size: int) -> list:
    """Say in each entry's reason when the call is computed in slabs (``LMSConfig.slab_bytes``)."""
    slab_bytes = planned_slab_bytes(entries)
    offloaded_rows = [list(e.tensor_offloaded) for e in entries]
    plans = facts.slab_plans(calls, offloaded_rows, batch_size, slab_bytes)
    chains = facts.fused_slab_chains(calls, offloaded_rows, plans)
    fused_sources = {source for source, _ in chains.values()}
    sweep_plan.note_pooling_folds(calls, entries, facts, offloaded_rows, plans)
    for i, plan in plans.items():
        entries[i].reason += f"; computed in {plan.count} slabs of {format_bytes(slab_bytes)} along axis 1"
        if plan.moments and i not in fused_sources:  # say why its copy comes back twice
            entries[i].reason += TWICE_NOTE
    for v, (source, between) in chains.items():
        if between is None:  # an activation whose output windows are recomputed from the source's input copy
            note_short_chain(calls, entries, v, source)
            continue
        entries[v].recompute_from = (source, between)
        # the input is recomputed from the source's host copy, not copied (BackendFacts.fused_slab_chains)
        entries[v].offloaded_bytes = entries[v].new_host_bytes = 0
        names = (calls[source].unit.name, calls[between].unit.name, calls[v].unit.name)
        slab_note = entries[v].reason.split(";", 1)[1] if ";" in entries[v].reason else ""
        entries[v].reason = (f"recomputed: its input from {names[0]}'s host copy through {names[1]}, nothing "
                             f"copied (fused chain);{slab_note}")
        entries[between].reason += f"; its gradient is taken in {names[2]}'s backward (fused chain)"
        entries[source].reason += f"; its first backward pass is taken in {names[2]}'s backward (fused chain)"
    return entries
