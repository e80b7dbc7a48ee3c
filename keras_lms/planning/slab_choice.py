"""The slab size of a budget plan: among the sizes that fit ``device_budget``, the one whose step is fastest.

Why a choice: larger slabs recompute fewer halos and bring fewer window rows back; smaller ones hold less and let
more of the plan recompute in windows instead of copying. Why not the plain offload plan's step time: the plan
that runs is finished later (level sweeps, tensors recomputed in windows instead of copied), and its time
depends on the slab size differently. Timed without them, a 384^3 float32 3D U-Net at 28 GiB chose 4 GiB slabs
(nothing left to recompute in windows) and ran 6.0x the plain step on H100-PCIe5, where 512 MiB slabs give
2.1x. So each size is timed at the faster of the plan's two corners: every offloaded tensor copied, or every
level sweep run and every tensor the back end can recompute in windows recomputed (one timeline per size). The
finished plans of the 3D U-Net's budgets are within a few % of their faster corner. Within a few % is not close
enough to tell sizes apart whose corners tie: on GH200 the corner (every tensor copied) of the 400^3 float32 plan is
0.412, 0.416 and 0.416 s at 1 GiB, 512 MiB and 256 MiB slabs, and the finished plans 0.383, 0.379 and 0.392 s.
So the sizes whose corner is within ``SLAB_TIE`` of the best are handed back too (``tied``), and the planner
finishes the plan at each and keeps the fastest (``budget._finish_start``).
"""

from __future__ import annotations

import logging

from keras_lms.config import format_bytes
from keras_lms.planning.memory_model import simulate
from keras_lms.planning.step_time import predict_step_time

log = logging.getLogger(__name__)

# The smallest slab the budget planner tries when the configured slab size does not fit device_budget.
MIN_SLAB_BYTES = 16 << 20
# With a device profile, the planner also tries slabs up to this many doublings above the configured size.
SLAB_DOUBLINGS = 4
# Sizes whose corner step is within this fraction of the fastest one's tie with it: the planner finishes the plan
# at each of them too, at most SLAB_FINISHES sizes in all (the fastest corner first). 0: the corner alone decides.
SLAB_TIE = 0.03
SLAB_FINISHES = 3


def fastest_fitting_slab(calls, chosen, config, facts, batch_size: int, static_bytes: int, update_bytes: int,
                         slab_bytes: int, memory):
    """(slab size, StepMemory, tied sizes) among the slab sizes (``slab_bytes`` halved down to MIN_SLAB_BYTES, doubled
    SLAB_DOUBLINGS times) whose prediction fits ``config.device_budget`` with the offload decisions ``chosen``:
    the one with the shortest corner step on ``config.device_profile`` (the faster of ``copied_seconds``, which a
    fast link like GH200's favours, and ``windowed_seconds``); between equal steps, the one timed fastest with
    every offloaded tensor copied. ``slab_bytes`` (with ``memory``) fits. The tied sizes: the other fitting
    sizes whose corner is within ``SLAB_TIE`` of the chosen one's, fastest corner first (module docstring)."""
    if not slab_bytes:
        return slab_bytes, memory, ()
    sizes = {slab_bytes << k for k in range(1, SLAB_DOUBLINGS + 1)}
    size = slab_bytes // 2
    while size >= MIN_SLAB_BYTES:
        sizes.add(size)
        size //= 2

    fitting = {slab_bytes: memory}
    for size in sorted(sizes):
        candidate = simulate(calls, chosen, facts, batch_size, config.prefetch, static_bytes,
                             update_bytes=update_bytes, lean_normalization=config.lean_normalization,
                             slab_bytes=size)
        if candidate.budget_bytes <= config.device_budget:
            fitting[size] = candidate
    copied = {size: copied_seconds(calls, chosen, config, facts, batch_size, size) for size in fitting}
    corner = {size: min(copied[size], windowed_seconds(calls, chosen, config, facts, batch_size, size))
              for size in fitting}
    ranked = sorted(sorted(fitting), key=lambda size: (corner[size], copied[size]))
    best = ranked[0]
    if best != slab_bytes:
        log.info("keras-lms: slabs of %s (predicted step %.3f s on %s, at the faster corner) instead of %s.",
                 format_bytes(best), corner[best], config.device_profile.name, format_bytes(slab_bytes))
    tied = tuple(size for size in ranked[1:SLAB_FINISHES] if corner[size] <= corner[best] * (1 + SLAB_TIE))
    return best, fitting[best], tied


def windowed_seconds(calls, offloaded, config, facts, batch_size: int, slab_bytes: int) -> float:
    """The predicted step of the offload decisions ``offloaded`` computed in slabs of ``slab_bytes``, with every
    level sweep the back end offers (``BackendFacts.slab_sweeps``) and every tensor it can recompute in windows
    recomputed instead of copied (``BackendFacts.recompute_sources``): one timeline per size (the planner's
    own sweep search times each sweep on and off)."""
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes)
    recomputed, swept = frozenset(), {}
    if slabs:
        chains = facts.fused_slab_chains(calls, offloaded, slabs, frozenset())
        sources = facts.recompute_sources(calls, offloaded, slabs, chains, batch_size)
        recomputed = frozenset(s.producer for s in sources.values() if s.chosen)
        swept = {sweep.first: sweep.windows for sweep in facts.slab_sweeps(calls, offloaded, slabs)}
    return predict_step_time(calls, offloaded, facts, config.device_profile, batch_size, config.prefetch,
                             slab_bytes, config.lean_normalization, recomputed, swept).step_seconds


def copied_seconds(calls, offloaded, config, facts, batch_size: int, slab_bytes: int) -> float:
    """The predicted step of ``offloaded`` in slabs of ``slab_bytes`` with every offloaded tensor copied."""
    return predict_step_time(calls, offloaded, facts, config.device_profile, batch_size, config.prefetch,
                             slab_bytes, config.lean_normalization).step_seconds
