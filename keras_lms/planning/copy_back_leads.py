"""Copies back started earlier for the calls that wait for them: a prefetch depth per call, where it pays.

The plan's prefetch depth (``PlanEntry.prefetch``, ``prefetch_plan.plan_prefetch``) is one number for every call: a
depth deep enough for the backward that waits longest holds every other copy back longer too, and at the largest
volumes no deeper depth fits the budget. Yet the waits sit at a few calls: a BatchNormalization's backward whose
copy back (read twice, in windows) outlasts the short backward before it, a deep level's convolution whose copy
back queues behind the level above's on a busy link. Started a few calls earlier, those copies arrive in time,
and only they are held longer. At 16 GiB, the 3D U-Net's step predicted on GH200 at 400^3 float32 1.27x -> 1.20x
the plain step's, and on H100-PCIe5 2.16x -> 2.04x, with no rise of the predicted peak (docs/benchmarks.md).

The search is greedy over the calls that wait: a pass visits every call whose backward waits for its copies
(``StepTime.call_waits``) in the order the backward reaches them, times the leads ``EXTRA_LEADS`` beyond its own,
and takes the fastest that the memory model fits and that gains ``MIN_GAIN``; passes go on (at most
``MAX_PASSES``) while one gains. Why greedy and not a search over every assignment: moving one call's copies
earlier changes when the link is free for every later one, and the step model is a simulation, not a sum of
per-call terms, so a dynamic program over calls has no exact decomposition; each trial is one simulation, and a
pass over the calls that wait is a few hundred (2-3 s for the 3D U-Net at 400^3). Why a cap and not the budget
alone: a plan at the edge (``budget._plan_at_the_edge``) already peaks above the budget's margin; there a move
may only use room below the plan's own predicted peak.
"""

from __future__ import annotations

import logging

from keras_lms.planning.plan import lead_of, planned_leads, planned_prefetch
from keras_lms.planning.plan_measures import plan_memory, plan_time, plan_work

log = logging.getLogger("keras_lms")

# Off: every call's copies back start at the plan's depth (the control of tests/planning/test_copy_back_leads.py).
COPY_BACK_LEADS = True
# The leads a call is offered beyond its own (calls ahead in forward order; sparser deeper, where a call more or
# less changes little).
EXTRA_LEADS = (1, 2, 3, 4, 6, 8, 12, 16)
# A move must shorten the predicted step by this fraction to be taken (0.2 ms of a 0.4 s step; 0.2% left 1.21x
# where this gives 1.20x on GH200 at 400^3, and a tenth of it adds seconds of planning for 1%).
MIN_GAIN = 0.0005
# Passes over the calls that wait (a move changes when the link is free for the calls after it).
MAX_PASSES = 3
# Waits shorter than this (seconds) are not worth a search.
MIN_WAIT = 1e-4


def plan_copy_back_leads(calls, entries, config, facts, batch_size: int, static_bytes: int = 0,
                         update_bytes: int = 0) -> None:
    """Set ``PlanEntry.copy_back_lead`` on the calls whose copies back should start earlier than the plan's depth
    (see the module docstring). Needs a device profile and a back end that starts copies back per call
    (``BackendFacts.starts_copies_back_per_call``: not JAX, whose XLA places them); with ``prefetch=0`` (copies
    back only when their gradient arrives, the user's explicit choice) nothing moves. The memory cap is
    ``device_budget`` where the plan fits it with the margin, else the plan's own predicted peak with the margin
    (without a budget too)."""
    if (not COPY_BACK_LEADS or config.device_profile is None or config.prefetch < 1
            or not facts.starts_copies_back_per_call or not any(e.offloaded for e in entries)):
        return
    n = len(entries)
    planned = planned_leads(entries, config.prefetch)
    leads = [lead_of(planned, i) for i in range(n)]
    settings = (calls, entries, config, facts, batch_size)
    memory = plan_memory(*settings, static_bytes, update_bytes, prefetch=tuple(leads))
    cap = max(memory.budget_bytes, config.device_budget or 0)
    work = plan_work(calls, entries, facts, batch_size)  # (the same at every lead)
    current = plan_time(*settings, prefetch=tuple(leads), work=work)
    start = current.step_seconds
    for _ in range(MAX_PASSES):
        before = current.step_seconds
        waiting = [i for i, w in enumerate(current.call_waits) if w > MIN_WAIT and any(entries[i].tensor_offloaded)]
        for call in sorted(waiting, reverse=True):  # in the order the backward reaches them
            move = _best_lead(settings, static_bytes, update_bytes, leads, call, current, cap, work)
            if move is not None:
                leads[call], current = move
        if current.step_seconds > before * (1 - MIN_GAIN):
            break
    if current.step_seconds >= start:
        return
    depth = planned_prefetch(entries, config.prefetch)
    for entry, lead in zip(entries, leads):
        entry.copy_back_lead = lead if lead != depth else None
    moved = sum(e.copy_back_lead is not None for e in entries)
    log.info("keras-lms: copies back start earlier for %d calls (predicted step %.3f -> %.3f s on %s).", moved,
             start, current.step_seconds, config.device_profile.name)
    for entry in entries:
        if entry.copy_back_lead is not None:
            entry.reason += f"; copies back start {entry.copy_back_lead} calls ahead (its backward waited for them)"


def _best_lead(settings, static_bytes, update_bytes, leads, call, current, cap, work):
    """``(lead, StepTime)`` of the lead of ``call`` (among ``EXTRA_LEADS`` beyond its own) that shortens the
    predicted step most and fits ``cap``, or None where none gains ``MIN_GAIN``."""
    n = len(settings[0])
    best = None
    bar = current.step_seconds * (1 - MIN_GAIN)
    for extra in EXTRA_LEADS:
        lead = leads[call] + extra
        if call + lead >= n:
            break
        trial = tuple(leads[:call] + [lead] + leads[call + 1:])
        timed = plan_time(*settings, prefetch=trial, work=work)
        if timed.step_seconds >= (best[1].step_seconds if best else bar):
            continue
        if plan_memory(*settings, static_bytes, update_bytes, prefetch=trial).budget_bytes > cap:
            break  # deeper holds the copy longer still: no deeper lead fits either
        best = (lead, timed)
    return best
