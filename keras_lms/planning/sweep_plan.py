"""Which level sweeps a plan runs (TensorFlow's ``offload.tensorflow.sweeps``: runs of convolution ->
BatchNormalization -> activation units differentiated in passes over slab windows recomputed from the run's
input), chosen by the predicted step time on the device profile and recorded on the plan (``PlanEntry.sweep``).

Why a choice and not always: a sweep trades host-link bytes (only the run's input comes back) for recomputed
forward work (each unit once per pass that needs it). On a PCIe GPU that pays at every slab-computed level of a
3D U-Net; on GH200 the copies are cheaper than the recompute and none does. Without a profile nothing is swept.
"""

from __future__ import annotations

from keras_lms.planning.plan import planned_slab_bytes, planned_sweeps, sweep_setting, sweep_value
from keras_lms.planning.recompute import recomputed_producers
from keras_lms.planning.step_time import predict_step_time


def plan_sweeps(calls, entries, config, facts, batch_size: int) -> None:
    """Choose the level sweeps to run (``BackendFacts.slab_sweeps``): with a device profile, greedily in forward
    order, each one that shortens the predicted step (nothing recomputed yet; ``refine_sweeps`` revisits them
    once the recomputed tensors are chosen); every candidate where the back end forces them; none otherwise (the
    defaults without a profile stay the per-call backward). Recorded on the entries (``PlanEntry.sweep``), each
    with its default (thinnest) windows."""
    if not (facts.forced_sweeps() or config.device_profile is not None):
        return
    candidates, seconds = _search(calls, entries, config, facts, batch_size, frozenset())
    if not candidates:
        return
    if facts.forced_sweeps():
        chosen = {s.first: sweep_value(s.windows, s.held) for s in candidates}
    else:
        chosen, best = {}, seconds({})
        for sweep in candidates:
            trial = {**chosen, sweep.first: sweep.windows}
            t = seconds(trial)
            if t < best:
                chosen, best = trial, t
    _mark_sweeps(calls, entries, candidates, chosen, config)


def refine_sweeps(calls, entries, config, facts, batch_size: int) -> None:
    """With the recomputed tensors chosen, flip each candidate sweep once (on or off) where that shortens the
    predicted step: a sweep's passes read its input's windows, whose cost depends on whether that input is
    recomputed."""
    if facts.forced_sweeps():
        return
    candidates, seconds = _search(calls, entries, config, facts, batch_size, recomputed_producers(entries))
    if not candidates:
        return
    chosen = planned_sweeps(entries)
    best = seconds(chosen)
    for sweep in candidates:
        trial = dict(chosen)
        if trial.pop(sweep.first, None) is None:
            trial[sweep.first] = sweep.windows
        t = seconds(trial)
        if t < best - 1e-9:
            chosen, best = trial, t
    if chosen != planned_sweeps(entries):
        _mark_sweeps(calls, entries, candidates, chosen, config)


def plan_sweep_windows(calls, entries, config, facts, batch_size: int, fits, holds: bool = True,
                       unswept: bool = False) -> None:
    """Thicker windows and held units where the device budget has room: for each planned sweep in turn, its other
    window counts (``Sweep.window_options``: as thick as its units' slabs) and its sets of held units
    (``Sweep.hold_options``: convolution outputs kept on the device between the passes), kept where the plan
    still ``fits(swept)`` (the memory model with the budget margin) and the predicted step is shorter. Why: a
    pass holds every unit's window at once, so the default windows are half a slab thick, which recomputes twice
    the halo rows (at 384^3 float32 with a 16 GiB budget 15% of the predicted step, docs/design.md, "Level
    sweeps"); and without held units each pass B convolves again what pass A convolved. ``unswept``: also the
    runs the plan does not sweep (their windows may be faster only thicker than their default), where grappler's
    own estimate is known not to move with them (``budget._finish_at_the_edge``)."""
    chosen = planned_sweeps(entries)
    if not chosen and not unswept:
        return
    candidates, seconds = _search(calls, entries, config, facts, batch_size, recomputed_producers(entries))
    best = seconds(chosen)
    for sweep in candidates:
        if sweep.first not in chosen and not unswept:
            # (not a run the plan did not sweep, held or not: at 384^3 float32 with 16 GiB a held sweep of the
            # level-0 decoder was predicted faster, but its whole output gradient, sliced by every window of
            # pass B, became grappler's swap candidate on a 16 GiB GPU: 54-58 swaps, 24 GiB each way, 16.8-19.1
            # GiB peaks; docs/design.md, "Held convolution outputs in sweeps")
            continue
        for windows in sweep.window_options:
            for held in ((),) + (tuple(sweep.hold_options) if holds else ()):
                setting = sweep_value(windows, held)
                if setting == chosen.get(sweep.first):
                    continue
                trial = {**chosen, sweep.first: setting}
                if fits(trial):
                    t = seconds(trial)
                    if t < best - 1e-9:
                        chosen, best = trial, t
    if chosen != planned_sweeps(entries):
        _mark_sweeps(calls, entries, candidates, chosen, config)


def _search(calls, entries, config, facts, batch_size: int, recomputed):
    """The candidate sweeps of the plan's offload decisions and slabs, and ``seconds(swept)``: the predicted step
    on the profile with ``recomputed`` and the sweeps ``swept`` (first call -> windows)."""
    offloaded = [list(e.tensor_offloaded) for e in entries]
    slab_bytes = planned_slab_bytes(entries)
    slabs = facts.slab_plans(calls, offloaded, batch_size, slab_bytes)
    candidates = facts.slab_sweeps(calls, offloaded, slabs) if slabs else []

    def seconds(swept):
        return predict_step_time(calls, offloaded, facts, config.device_profile, batch_size, config.prefetch,
                                 slab_bytes, config.lean_normalization, recomputed, swept).step_seconds

    return candidates, seconds


def note_swept_host_bytes(entries) -> None:
    """A swept run's calls but its first copy nothing to host: the copies of the tensors inside the run have no
    reader (the passes recompute them) and TensorFlow prunes them, so they hold no host memory. (Not a BatchNorm
    whose input copy a fused chain outside its run reads: a run longer than ``sweeps.MAX_UNITS`` units goes on
    in the next run, whose first convolution recomputes its input from that copy.)"""
    read_outside = {e.recompute_from[0] for e in entries
                    if e.recompute_from is not None and not (e.sweep and e.recompute_from[0] in e.sweep)}
    for entry in entries:
        if entry.sweep and entry.index != entry.sweep[0] and entry.index not in read_outside:
            entry.offloaded_bytes = entry.new_host_bytes = 0


def _mark_sweeps(calls, entries, candidates, chosen, config) -> None:
    """Record ``chosen`` on the entries: each swept call's ``sweep``, windows, held units and a note in its reason.
    A run marked before and not chosen now loses its note alone (``refine_sweeps`` runs after the recompute notes
    were added behind it)."""
    why = f"faster on {config.device_profile.name}" if config.device_profile is not None else "forced"
    for sweep in candidates:
        for i in sweep.calls:
            if entries[i].sweep is not None:
                note = _note(calls, sweep, entries[i].sweep_windows, entries[i].sweep_held, why)
                entries[i].reason = entries[i].reason.replace(note, "")
                entries[i].sweep, entries[i].sweep_windows, entries[i].sweep_held = None, None, ()
                entries[i].sweep_folded = None
            if sweep.first in chosen:
                windows, held = sweep_setting(chosen[sweep.first])
                entries[i].sweep, entries[i].sweep_windows, entries[i].sweep_held = sweep.calls, windows, held
                entries[i].sweep_folded = (sweep.folded, sweep.align) if sweep.folded is not None else None
                entries[i].reason += _note(calls, sweep, windows, held, why)
        if sweep.folded is not None:
            act = sweep.units[-1][2]
            note = (f"; its input gradient is taken in {calls[act].unit.name}'s level sweep, window "
                    "by window (no windows of its own read back)")
            own = pooling_fold_note(calls, act)  # (the fold where the level is not swept)
            entries[sweep.folded].reason = entries[sweep.folded].reason.replace(note, "").replace(own, "")
            if sweep.first in chosen:
                entries[sweep.folded].reason += note
            elif entries[act].folded_pooling is not None:
                entries[sweep.folded].reason += own


def note_pooling_folds(calls, entries, facts, offloaded, slabs: dict) -> None:
    """Record the back end's pooling folds (``BackendFacts.pooling_folds``: pooling -> (activation, stride)) on
    the activations' entries (``PlanEntry.folded_pooling``) and the windows they align
    (``BackendFacts.slab_alignments``: ``PlanEntry.slab_align``), which the step reads, and say so in the
    poolings' reasons; a level sweep of the activation chosen later takes the fold over (``_mark_sweeps``)."""
    for pool, (act, stride) in facts.pooling_folds(calls, offloaded, slabs).items():
        entries[act].folded_pooling = (pool, stride)
        entries[pool].reason += pooling_fold_note(calls, act)
    for i, stride in facts.slab_alignments(calls, offloaded, slabs).items():
        entries[i].slab_align = stride


def pooling_fold_note(calls, act: int) -> str:
    return (f"; its input gradient is taken in {calls[act].unit.name}'s slab backward, window by window (no "
            "windows of its own read back)")


def _note(calls, sweep, windows: int, held: tuple, why: str) -> str:
    """What a swept call's reason says about its sweep."""
    names = ", ".join(calls[i].unit.name for i in sweep.calls)
    kept = ", ".join(calls[sweep.units[j - 1][0]].unit.name for j in held)
    held_note = f"; the outputs of {kept} held on the device between the passes" if held else ""
    return (f"; differentiated in a level sweep ({names}): {len(sweep.units) + 1} passes over {windows} slab "
            f"windows recomputed from {calls[sweep.first].unit.name}'s input{held_note} ({why})")
