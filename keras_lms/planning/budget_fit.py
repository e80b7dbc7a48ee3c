"""Narrowing the rules' offload decisions to ``device_budget`` (the budget planner's start): the fewest offloads
that fit, largest bytes x distance first, or every eligible one; smaller slabs where even that does not fit; and
``BudgetError`` naming the largest call where nothing fits. What the plan then adds (sweeps, recompute, keeps):
``budget``."""

from __future__ import annotations

import dataclasses
import logging

from keras_lms.config import format_bytes
from keras_lms.planning.memory_model import simulate, tensor_sizes
from keras_lms.planning.plan import CallDecision
from keras_lms.planning.slab_choice import MIN_SLAB_BYTES, fastest_fitting_slab

log = logging.getLogger(__name__)


class BudgetError(ValueError):
    """The step cannot fit the device budget even with every eligible tensor offloaded."""


@dataclasses.dataclass(frozen=True)
class BudgetStart:
    """A start of the budget planner (``fit_budget``): the per-call decisions, at the slab size the corner step
    chose, and the other slab sizes whose corner ties with it (``slab_choice.fastest_fitting_slab``), at which the
    planner finishes the plan too."""

    decisions: list
    tied_slab_bytes: tuple = ()

    def at_slab_bytes(self, slab_bytes: int) -> list:
        """The decisions with the offloaded calls computed in slabs of ``slab_bytes``."""
        return [d if d.slab_bytes is None else dataclasses.replace(d, slab_bytes=slab_bytes)
                for d in self.decisions]


def fit_budget(calls, decisions, config, facts, batch_size: int, static_bytes: int, update_bytes: int = 0,
               offload_all: bool = False) -> BudgetStart:
    """Narrow ``decisions`` (from the min_bytes/keep_last/include/exclude policy) to fit ``device_budget``: the
    fewest offloads that fit, largest bytes x distance first, or with ``offload_all`` every eligible one (once
    the step does not fit without offloading), as a ``BudgetStart`` (with the slab sizes that tie).

    Compares ``StepMemory.budget_bytes`` (the prediction with BUDGET_MARGIN on activations) with the budget.
    """
    budget = config.device_budget
    none = [[False] * len(d.offload_tensor) for d in decisions]
    plain = simulate(calls, none, facts, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                     lean_normalization=config.lean_normalization, slab_bytes=config.slab_bytes)
    if plain.budget_bytes <= budget:
        log.info("keras-lms: LMS not needed: the step is predicted to need %s, within device_budget %s.",
                 format_bytes(plain.budget_bytes), format_bytes(budget))
        reason = (f"kept: LMS not needed, the step fits device_budget {format_bytes(budget)} "
                  f"(predicted {format_bytes(plain.budget_bytes)} with the planner's margin)")
        return BudgetStart([CallDecision(list(row), reason) for row in none])
    sizes_in, sizes_out, _ = tensor_sizes(calls, batch_size)
    n = len(calls)
    candidates = [i for i, d in enumerate(decisions) if d.offloaded]
    score = {i: sum(s for s, off in zip(sizes_in[i], decisions[i].offload_tensor) if off) * (n - i) for i in candidates}
    candidates.sort(key=lambda i: -score[i])
    chosen = [list(row) for row in none]
    memory = plain
    for k, i in enumerate(candidates):
        chosen[i] = list(decisions[i].offload_tensor)
        if offload_all and k + 1 < len(candidates):
            continue
        memory = simulate(calls, chosen, facts, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                          lean_normalization=config.lean_normalization, slab_bytes=config.slab_bytes)
        if memory.budget_bytes <= budget:
            break
    slab_bytes, tied = config.slab_bytes, ()
    while memory.budget_bytes > budget and slab_bytes // 2 >= MIN_SLAB_BYTES:
        # Everything offloaded and still too large: smaller slabs hold smaller working sets (where planned).
        smaller = simulate(calls, chosen, facts, batch_size, config.prefetch, static_bytes, update_bytes=update_bytes,
                           lean_normalization=config.lean_normalization, slab_bytes=slab_bytes // 2)
        if smaller.budget_bytes >= memory.budget_bytes:
            break
        slab_bytes, memory = slab_bytes // 2, smaller
    if memory.budget_bytes <= budget and config.device_profile is not None:
        slab_bytes, memory, tied = fastest_fitting_slab(calls, chosen, config, facts, batch_size, static_bytes,
                                                        update_bytes, slab_bytes, memory)
    if memory.budget_bytes > budget:
        slabs = facts.slab_plans(calls, chosen, batch_size, slab_bytes)
        built = set(range(n)) - set(facts.elided_concatenations(calls, slabs, batch_size) if slabs else ())
        largest = max(built or range(n), key=lambda i: sum(sizes_in[i]) + sum(sizes_out[i]))  # (never built: not)
        need = sum(sizes_in[largest]) + sum(sizes_out[largest])
        raise BudgetError(
            f"device_budget {format_bytes(budget)} cannot be met: with every eligible tensor offloaded the step is "
            f"predicted to need {format_bytes(memory.budget_bytes)} with the planner's margin "
            f"({format_bytes(static_bytes)} of weights, gradients and optimizer state"
            + (f", {format_bytes(update_bytes)} of optimizer-update temporaries" if update_bytes else "")
            + f"). The largest single layer call is {calls[largest].unit.name!r} "
            f"({format_bytes(need)} for its inputs and outputs at batch size {batch_size}). Use a smaller batch "
            "or input, a larger budget, or lower min_bytes/keep_last."
        )
    log.info("keras-lms: offloading %d of %d layer calls to fit device_budget %s (predicted peak %s).",
             sum(any(r) for r in chosen), n, format_bytes(budget), format_bytes(memory.budget_bytes))
    if slab_bytes != config.slab_bytes:
        log.info("keras-lms: slabs of %s instead of slab_bytes=%s to fit device_budget %s.",
                 format_bytes(slab_bytes), format_bytes(config.slab_bytes), format_bytes(budget))
    out = []
    for i, d in enumerate(decisions):
        if any(chosen[i]):
            out.append(CallDecision(chosen[i], d.reason + f" (needed for device_budget {format_bytes(budget)})",
                                           slab_bytes))
        elif d.offloaded:
            out.append(CallDecision(chosen[i], f"kept: device_budget {format_bytes(budget)} is met without it"))
        else:
            out.append(d)
    return BudgetStart(out, tied)
