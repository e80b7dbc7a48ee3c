"""Short fused chains where the budget has room for them, chosen by the time they save.

A short chain (``offload.tensorflow.slab_chains``) is a slab-computed ``BatchNormalization -> activation`` pair
whose activation output goes to host for other readers (a U-Net's skip, read by the pooling and the decoder):
the activation's backward cuts windows of the BatchNorm input's host copy instead of its own output's (the same
bytes), recomputes its output on them and takes BatchNorm's first backward pass there, so BatchNorm's backward
brings its input back once instead of twice. On GH200 that is the largest wait left in the step (at 448^3
mixed_float16 the level-0 BatchNorms each wait ~9 ms for their second 2.7 GiB read). Its price is memory: the
activation's backward holds the recomputed BatchNorm temporaries (float32 under mixed precision) while the
skip's and the pooling's gradients are live, which is the step's peak at the largest cubes, so it cannot be on
by default (``BackendFacts.short_chain_bytes`` charges it).

The search is the keep search's (``keep_plan``): each candidate alone, those that fit the budget (the memory
model with the planner's margin) and shorten the predicted step taken greedily, best first, each re-checked
with the ones already taken.
"""

from __future__ import annotations

from keras_lms.planning.keep_plan import best_first
from keras_lms.planning.plan import planned_slab_bytes
from keras_lms.planning.recompute import recomputed_producers

# What a slab BatchNorm's reason says until a short chain takes its first pass (``budget._note_slabs``).
TWICE_NOTE = " (its input windows come back twice: BatchNorm's two backward passes)"


def plan_short_chains(calls, entries, facts, batch_size: int, step_seconds, fits) -> None:
    """Fuse the short chains that fit the budget and shorten the predicted step (``step_seconds`` and ``fits``
    take the set of short chains, the plan's other decisions as they are), outside level sweeps and recomputed
    tensors, and record them on ``entries``."""
    offloaded = [list(e.tensor_offloaded) for e in entries]
    slabs = facts.slab_plans(calls, offloaded, batch_size, planned_slab_bytes(entries))
    chains = facts.fused_slab_chains(calls, offloaded, slabs, True) if slabs else {}
    busy = {i for e in entries if e.sweep for i in e.sweep} | recomputed_producers(entries)
    candidates = {r: b for r, (b, between) in chains.items() if between is None and not {r, b} & busy}
    for r in sorted(choose_short_chains(candidates, step_seconds, fits)):
        note_short_chain(calls, entries, r, candidates[r])


def choose_short_chains(candidates, step_seconds, fits) -> frozenset:
    """The short chains to fuse (see the module docstring).

    Args:
        candidates: the activations that could take their BatchNorm's first pass (call indices).
        step_seconds: ``short chains -> predicted step seconds`` with the plan's other decisions.
        fits: ``short chains -> bool``: the plan still fits the device budget.

    Returns:
        The chosen activations' call indices.
    """
    return frozenset(best_first(sorted(candidates), step_seconds, fits))


def note_short_chain(calls, entries, activation: int, source: int) -> None:
    """Record a short chain on the plan's entries (``PlanEntry.recompute_from``, which the step executes) and
    say so in both reasons."""
    entries[activation].recompute_from = (source, None)
    names = (calls[source].unit.name, calls[activation].unit.name)
    entries[activation].reason += f"; its output recomputed from {names[0]}'s host copy in its backward (fused chain)"
    entries[source].reason += f"; its first backward pass is taken in {names[1]}'s backward (fused chain)"
    entries[source].reason = entries[source].reason.replace(TWICE_NOTE, "")
