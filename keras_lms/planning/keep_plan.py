"""Keep on the device what the budget has room for, chosen by the time its copies cost (the "keep" of the plan's
keep / copy / recompute decision, made by the step-time model).

Why: the budget planner (``budget.fit_budget``) offloads tensors by bytes x distance until the memory model fits
``device_budget``, before it knows what the rest of the plan saves. The level sweeps and the recomputed tensors
chosen after it hold less than the copies they replace, so the finished plan often has room left: at 448^3
mixed_float16 with a 16 GiB budget the H100-PCIe5 plan is predicted at 13.6 GiB of the budget's 16 (margin
included), while the decoder's level-1 tensors still go over a 35 GB/s link. Keeping four calls cuts the
predicted step by 5% there, 2.45x -> 2.32x the plain step (docs/benchmarks.md). Which ones is a question of
time, not of bytes: a tensor whose copy back hides behind its backward's compute costs nothing to offload, one
the backward waits for costs all of its transfer.

The search: every offloaded call alone, kept whole (its inputs stay on the device), with the plan's other
decisions as they are; those that fit the budget (the memory model with the planner's margin) and shorten the
predicted step are then taken greedily, best first, each re-checked with the ones already taken. The caller
re-plans the sweeps, recomputed tensors and prefetch for the new decisions and keeps whichever finished plan is
faster. Greedy, because the gains interact through one shared link and one memory peak: an exact search over
subsets would cost far more planning time than ``wrap()`` can spend, for a few milliseconds of step.
"""

from __future__ import annotations

from keras_lms.planning.plan import CallDecision, offloaded_keys

# A kept call must shorten the predicted step by at least this share of it (below the model's accuracy, a kept
# tensor only costs memory).
MIN_GAIN = 1e-3


def kept_row(offloaded, indices) -> list:
    """``offloaded`` with every input of the calls ``indices`` kept on the device."""
    out = [list(row) for row in offloaded]
    for i in indices:
        out[i] = [False] * len(out[i])
    return out


def calls_to_keep(offloaded, step_seconds, fits, candidates=None) -> dict:
    """The offloaded calls to keep on the device instead (see the module docstring).

    Args:
        offloaded: per call, per input: whether the plan copies it to host.
        step_seconds: ``offloaded -> predicted step seconds`` with the plan's other decisions.
        fits: ``offloaded -> bool``: the plan still fits the device budget.
        candidates: the calls worth trying (None: every offloaded one); the caller leaves out calls whose
            backward reads none of their inputs, whose "offload" copies nothing.

    Returns:
        ``{call index: seconds its keeping saved when it was taken}``, in the order they were taken.
    """
    tried = [i for i, row in enumerate(offloaded) if any(row) and (candidates is None or i in candidates)]
    return best_first(tried, lambda kept: step_seconds(kept_row(offloaded, kept)),
                      lambda kept: fits(kept_row(offloaded, kept)))


def best_first(candidates, step_seconds, fits) -> dict:
    """The greedy search of the keep and short-chain plans: each candidate alone (``step_seconds`` and ``fits``
    take a set of candidates, the rest of the plan as it is); those that fit and shorten the step by at least
    ``MIN_GAIN`` taken best first, each re-checked with the ones already taken. ``{candidate: seconds its
    taking saved}``, in the order they were taken."""
    best = step_seconds(frozenset())
    min_gain = best * MIN_GAIN
    singles = []
    for c in candidates:
        trial = frozenset({c})
        if fits(trial):
            seconds = step_seconds(trial)
            if seconds < best - min_gain:
                singles.append((seconds, c))
    taken = {}
    for _, c in sorted(singles):
        trial = frozenset({*taken, c})
        if not fits(trial):
            continue
        seconds = step_seconds(trial)
        if seconds < best - min_gain:
            taken[c] = best - seconds
            best = seconds
    return taken


def keep_decisions(decisions, saved_seconds: dict, profile_name: str) -> list:
    """``decisions`` with the calls of ``saved_seconds`` (index -> seconds, ``calls_to_keep``) kept, each with
    its reason: the predicted step time its copies would cost on the profile."""
    out = list(decisions)
    for i in saved_seconds:
        d = decisions[i]
        out[i] = CallDecision([False] * len(d.offload_tensor),
                              f"kept: device_budget has room for it, and its copies to host and back would make "
                              f"the predicted step {saved_seconds[i] * 1e3:.1f} ms longer on {profile_name}",
                              d.slab_bytes, d.recompute_from)
    return out


def keep_unread_activation_outputs(calls, decisions, facts) -> list:
    """Keep the activation calls differentiated from their output whose output no consumer offloads.

    Such a call's backward reads its output from its consumer's host copy (``BackendFacts.reads_output_host_copy``).
    When every consumer keeps the output on the device for its own backward (the last layers, ``keep_last``),
    there is no host copy to read and nothing to free: the output is on the device anyway. Offloaded, the torch
    back end would copy it to host and back for nothing (a full-size level-0 tensor before a U-Net's head)."""
    copied = offloaded_keys(calls, decisions)
    out = list(decisions)
    for i, (call, d) in enumerate(zip(calls, decisions)):
        if (d.offloaded and facts.output_gradient_activation(call.unit) is not None and call.output_keys
                and not copied & set(call.output_keys)):
            out[i] = CallDecision([False] * len(d.offload_tensor),
                                  "kept: its gradient reads its output, which its consumers keep on the device",
                                  d.slab_bytes, d.recompute_from)
    return out
