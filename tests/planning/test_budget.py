"""The budget planner on hand-built calls (no tracing): nothing offloaded when the step fits, the largest and
longest-lived inputs first when it does not, and a clear error when even full offload cannot fit."""

from __future__ import annotations

import keras
import pytest

from keras_lms.config import LMSConfig
from keras_lms.planning import BackendFacts, BudgetError, build_plan, simulate
from tests.planning.calls import floats, raw_call

FACTS = BackendFacts()
KIB = 1024


def chain():
    """Four Dense calls on 16 KiB inputs (batch 1): the peak is the first backward, where every input waits."""
    sizes = [4096] * 5
    return [raw_call(keras.layers.Dense(sizes[i + 1], name=f"d{i}"), [(f"t{i}", floats(sizes[i]))],
                     [(f"t{i + 1}", floats(sizes[i + 1]))]) for i in range(4)]


def peak(calls, entries):
    return simulate(calls, [list(e.tensor_offloaded) for e in entries], FACTS).budget_bytes


def test_nothing_is_offloaded_when_the_step_fits():
    entries = build_plan(chain(), LMSConfig(min_bytes=0, keep_last=0, device_budget="1GiB"), FACTS)
    assert not any(e.offloaded for e in entries)
    assert entries[0].reason.startswith("kept: LMS not needed")


def test_the_largest_longest_lived_input_goes_first():
    calls = chain()
    plain = simulate(calls, [[False]] * 4, FACTS).budget_bytes
    first_only = simulate(calls, [[True], [False], [False], [False]], FACTS).budget_bytes
    assert first_only < plain
    budget = first_only  # offloading d0's input (the longest-lived) is enough
    entries = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget), FACTS)
    assert [e.offloaded for e in entries] == [True, False, False, False]
    assert "needed for device_budget" in entries[0].reason
    assert entries[1].reason.startswith("kept: device_budget")
    assert peak(calls, entries) <= budget


def test_an_impossible_budget_names_the_largest_call():
    with pytest.raises(BudgetError, match=r"largest single layer call is 'd0' \(32.0 KiB"):
        build_plan(chain(), LMSConfig(min_bytes=0, keep_last=0, device_budget="10KiB"), FACTS)


def test_static_and_update_bytes_count_against_the_budget():
    calls = chain()
    plain = simulate(calls, [[False]] * 4, FACTS).budget_bytes
    fits = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=plain), FACTS)
    assert not any(e.offloaded for e in fits)
    with_weights = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=plain), FACTS,
                              static_bytes=8 * KIB)
    assert any(e.offloaded for e in with_weights)
    with pytest.raises(BudgetError, match="optimizer-update temporaries"):
        build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=plain), FACTS, update_bytes=plain + 1)
