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


def test_with_a_profile_copies_back_start_earlier_where_the_budget_has_room():
    # A slow host -> device link: the copy back of d0's 16 KiB input takes 164 ms, each Dense backward 67 ms.
    # One call of lead leaves most of it exposed; more lead hides it, and holds it on the device longer: up
    # to four calls ahead the step fits the budget, five do not.
    from keras_lms.planning.device_profile import DeviceProfile
    from keras_lms.planning.step_time import predict_step_time

    def link(h2d):
        return DeviceProfile(name="link", description="a link", flops_per_second={"float32": 1e9},
                             elementwise_bytes_per_second=1e12, host_to_device_bytes_per_second=h2d,
                             device_to_host_bytes_per_second=1e9, host_to_device_concurrent_bytes_per_second=h2d,
                             device_to_host_concurrent_bytes_per_second=1e9)

    calls = [raw_call(keras.layers.Dense(4096, name=f"d{i}"), [(f"t{i}", floats(4096))],
                      [(f"t{i + 1}", floats(4096))]) for i in range(6)]
    offload_first = [[True]] + [[False]] * 5
    budget = simulate(calls, offload_first, FACTS, prefetch=1).budget_bytes
    assert simulate(calls, offload_first, FACTS, prefetch=4).budget_bytes == budget
    assert simulate(calls, offload_first, FACTS, prefetch=5).budget_bytes > budget
    config = LMSConfig(min_bytes=0, keep_last=0, device_budget=budget, device_profile=link(1e5))
    entries = build_plan(calls, config, FACTS)
    assert [e.offloaded for e in entries] == [True] + [False] * 5
    chosen = entries[0].prefetch
    assert chosen in (2, 3, 4) and all(e.prefetch == chosen for e in entries)  # five calls ahead do not fit
    seconds = [predict_step_time(calls, offload_first, FACTS, link(1e5), prefetch=p).step_seconds for p in (1, chosen)]
    assert seconds[1] < 0.9 * seconds[0]
    # the controls: a link fast enough to hide the copy behind one call keeps the configured prefetch, and
    # without a profile the planner does not look at time at all
    fast = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget, device_profile=link(1e12)),
                      FACTS)
    assert fast[0].offloaded and all(e.prefetch is None for e in fast)
    untimed = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget), FACTS)
    assert all(e.prefetch is None for e in untimed)



def test_a_budget_met_only_without_the_margin_is_planned_within_the_defaults(caplog, monkeypatch):
    """At the largest volume a budget allows, the margin refused a budget the defaults' plan (no budget, every
    eligible tensor offloaded) is predicted to meet: now the budget gets the defaults' plan, with a warning and a
    reason that say so. A budget below the defaults' own prediction is still refused."""
    import logging

    from keras_lms.planning import budget as planner

    calls = chain()
    config = LMSConfig(min_bytes=0, keep_last=0)
    defaults = build_plan(calls, config, FACTS)
    memory = simulate(calls, [list(e.tensor_offloaded) for e in defaults], FACTS)
    assert memory.peak_bytes < memory.budget_bytes  # (the margin on the activations)
    budget = memory.peak_bytes  # met by the defaults' prediction, not with the margin
    with caplog.at_level(logging.WARNING, logger="keras_lms.planning.budget"):
        entries = build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget), FACTS)
    assert [e.tensor_offloaded for e in entries] == [e.tensor_offloaded for e in defaults]
    assert "met only without the planner's 15% margin" in caplog.text
    offloaded = [e for e in entries if e.offloaded]
    assert offloaded and all("is met only without the planner's margin" in e.reason for e in offloaded)
    with pytest.raises(BudgetError, match="cannot be met"):
        build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget - 1), FACTS)

    def refuse(*args):  # the control: the planner before, which refused what the margin refuses
        raise args[-1]

    monkeypatch.setattr(planner, "_plan_at_the_edge", refuse)
    with pytest.raises(BudgetError, match="cannot be met"):
        build_plan(calls, LMSConfig(min_bytes=0, keep_last=0, device_budget=budget), FACTS)
