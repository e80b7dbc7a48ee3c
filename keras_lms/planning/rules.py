"""The per-call rules: which tensors go to host by min_bytes, keep_last and include/exclude, and why.

Pure Python over shapes and counts, shared by the planner (``budget.build_plan``), the back ends' step contexts
(a call that differs from the plan is decided here on the spot) and the report, so "what is offloaded" is
decided in exactly one place. The budget planner may then narrow these decisions to ``device_budget``.
"""

from __future__ import annotations

from typing import Sequence

from keras_lms.config import LMSConfig, format_bytes
from keras_lms.planning.plan import CallDecision, RawCall, tensor_bytes


def matches(selectors, unit, enclosing_models: Sequence[str]) -> bool:
    """Whether a unit is selected by names (its own or an enclosing model's), classes or predicates."""
    for selector in selectors:
        if isinstance(selector, str):
            if selector == unit.name or selector in enclosing_models:
                return True
        elif isinstance(selector, type):
            if isinstance(unit, selector):
                return True
        elif selector(unit):
            return True
    return False


def check_selector_names(config: LMSConfig, known_names: set) -> None:
    """Unknown names in include/exclude are almost always typos; refuse them with the known names."""
    for key in ("include", "exclude"):
        selectors = getattr(config, key) or ()
        unknown = [s for s in selectors if isinstance(s, str) and s not in known_names]
        if unknown:
            sample = ", ".join(sorted(known_names)[:25])
            raise ValueError(
                f"{key} names unknown layer(s) {unknown}. Use names of the model's layers or nested models "
                f"(model.summary() lists them); known names include: {sample}"
                + (" ..." if len(known_names) > 25 else "")
            )


def decide(config: LMSConfig, unit, enclosing_models, index: int, total: int | None, sizes: list,
           ranks: list, offloadable: str | None = None) -> CallDecision:
    """Decide which inputs of call ``index`` (of ``total`` calls per step) go to host, and say why.

    ``sizes`` and ``ranks`` describe the call's input tensors. ``offloadable`` is a reason string when the
    back end cannot offload this call at all (e.g. a quantized layer).
    """
    none = [False] * len(sizes)
    if offloadable is not None:
        return CallDecision(none, f"kept: {offloadable}")
    if config.exclude and matches(config.exclude, unit, enclosing_models):
        return CallDecision(none, "kept: excluded by exclude=")
    if config.include and not matches(config.include, unit, enclosing_models):
        return CallDecision(none, "kept: not selected by include=")
    if total is not None and config.keep_last and index >= total - config.keep_last:
        return CallDecision(none, f"kept: among the last {config.keep_last} layer call(s) (keep_last)")
    eligible = [rank >= 1 and size >= config.min_bytes and size > 0 for size, rank in zip(sizes, ranks)]
    if not any(eligible):
        largest = max(sizes) if sizes else 0
        return CallDecision(none, f"kept: largest input {format_bytes(largest)} < min_bytes "
                                  f"{format_bytes(config.min_bytes)}")
    moved = sum(s for s, e in zip(sizes, eligible) if e)
    return CallDecision(eligible, f"offloaded: {sum(eligible)} input tensor(s), {format_bytes(moved)}")


def decide_all(calls: Sequence[RawCall], config: LMSConfig, batch_size: int = 1) -> list:
    """The per-call rules (include/exclude, keep_last, min_bytes) for every call of one forward pass.

    The budget planner (``keras_lms.planning.budget.build_plan``) may then narrow these decisions to ``device_budget``.
    """
    total = len(calls)
    decisions = []
    for index, call in enumerate(calls):
        sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
        decisions.append(decide(config, call.unit, call.enclosing, index, total, sizes, call.ranks, call.offloadable))
    return decisions
