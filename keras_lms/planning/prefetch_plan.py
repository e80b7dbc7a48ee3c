"""How early copies come back: the prefetch depth of a budget plan with a device profile (``plan_prefetch``)."""

from __future__ import annotations

import logging

from keras_lms.planning.plan_measures import fits_budget, plan_seconds

log = logging.getLogger(__name__)

# With a device profile and a budget, the planner tries starting copies back up to this many calls ahead.
MAX_PREFETCH = 8


def plan_prefetch(calls, entries, config, facts, batch_size: int, static_bytes: int = 0,
                  update_bytes: int = 0) -> None:
    """Start copies back earlier where the budget has room for them: among the prefetch depths from
    ``config.prefetch`` up to MAX_PREFETCH whose plan fits ``device_budget`` (a deeper prefetch holds each copy
    back on the device longer), the one with the shortest predicted step, recorded on every entry
    (``PlanEntry.prefetch``). Why: a backward that reads a large tensor waits for its copy back, which one call
    of lead hides only behind a call as long as the copy (an H200 step at 192^3 waits ~100 ms for copies with a
    lead of one call, ~65 ms with four: docs/benchmarks.md). ``prefetch=0`` (copies back only when their
    gradient arrives) is the user's explicit choice and is kept."""
    if config.prefetch < 1 or not any(e.offloaded for e in entries):
        return
    def seconds(prefetch):
        return plan_seconds(calls, entries, config, facts, batch_size, prefetch=prefetch)

    best, best_seconds = config.prefetch, seconds(config.prefetch)
    for prefetch in range(config.prefetch + 1, MAX_PREFETCH + 1):
        if not fits_budget(calls, entries, config, facts, batch_size, static_bytes, update_bytes, prefetch=prefetch):
            break  # deeper holds more: nothing further fits either
        t = seconds(prefetch)
        if t < best_seconds * 0.99:  # at least 1% faster for each step deeper
            best, best_seconds = prefetch, t
    if best == config.prefetch:
        return
    log.info("keras-lms: copies back start %d calls ahead instead of %d (predicted step %.3f s on %s).", best,
             config.prefetch, best_seconds, config.device_profile.name)
    for entry in entries:
        entry.prefetch = best
