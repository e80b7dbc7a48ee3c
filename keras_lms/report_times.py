"""The time side of the activation report: predicted step times per plan on a device profile, and each call's
decision in words (``keras_lms.report`` with ``device_profile=``)."""

from __future__ import annotations

from keras_lms.config import format_bytes
from keras_lms.planning.step_time import recomputes_forward


def plan_times(step, profile) -> dict:
    """Predicted ``StepTime`` of the plain step, the plan and its corners on ``profile``.

    The plain step has infinite memory (nothing copied, nothing recomputed): the reference every plan's time is
    set against. The corners of the planner's search: "offload-only" (every eligible tensor copied, nothing
    recomputed: keras-lms before the time-aware plan) and, where the back end can recompute tensors in windows,
    "recompute-all" (the plan's offload decisions and level sweeps with every candidate tensor recomputed instead
    of copied).
    A recompute-only plan without the host link at all is not listed: the recompute chains start from host
    copies (the input, a convolution's input), and the device-resident checkpoints a link-free plan would need
    are what does not fit in the first place.
    """
    none = [[False] * len(row) for row in step.offloaded]
    times = {"plain": step.step_time(profile, none), "as planned": step.step_time(profile),
             "offload-only": step.step_time(profile, step.offload_only())}
    candidates = step.recompute_candidates()
    if candidates:
        times["recompute-all"] = step.step_time(profile, recomputed=candidates)
    return times


def row_decision(step, index: int) -> str:
    """``keep``, ``copy`` (its inputs' host copies come back for its backward), ``copy+recompute`` (and its
    forward is recomputed from them) or ``recompute`` (its input is recomputed from another call's host copy:
    ``PlanEntry.recompute_from``, or it is an activation whose gradient reads only its output, recomputed)."""
    entry = step.entries[index]
    if entry.decision != "copy":
        return entry.decision  # keep, or recompute (its input comes from another call's host copy)
    if entry.recomputed_output and step.facts.backward_reads(step.calls[index].unit) == (False, True):
        return "recompute"  # its gradient reads only its output, which is recomputed, not copied (torch)
    recomputed = recomputes_forward(step.calls[index], step.facts, step.config.lean_normalization)
    return "copy+recompute" if recomputed else "copy"


def times_table(times: dict, profile):
    """A rich table of the predicted times (ms) per plan, set beside the plain step's."""
    from rich.table import Table

    table = Table(title=f"predicted step time (ms) on {profile.name} ({profile.description})")
    for column in ("plan", "compute", "recompute", "copies out", "copies back", "exposed copies", "step",
                   "x plain", "to host", "back"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    plain = times["plain"].step_seconds
    for name, t in times.items():
        table.add_row(name, _ms(t.compute_seconds), _ms(t.recompute_seconds), _ms(t.device_to_host_seconds),
                      _ms(t.host_to_device_seconds), _ms(t.exposed_seconds), _ms(t.step_seconds),
                      f"{t.step_seconds / plain:.2f}" if plain else "-",
                      format_bytes(t.device_to_host_bytes), format_bytes(t.host_to_device_bytes))
    return table


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"
