"""Copies back started earlier per call (``planning.copy_back_leads``), on hand-built calls: the call that waits
gets a deeper lead where one depth for every call would not fit, the step model and the memory model read the
per-call leads, and the controls (the search off, no profile, ``prefetch=0``) leave the plan's depth alone."""

from __future__ import annotations

import keras
import pytest

from keras_lms.config import LMSConfig
from keras_lms.planning import BackendFacts, build_plan, copy_back_leads, simulate
from keras_lms.planning.copy_back_leads import plan_copy_back_leads
from keras_lms.planning.device_profile import DeviceProfile
from keras_lms.planning.plan import deepest_lead, lead_of, planned_leads
from keras_lms.planning.step_time import predict_step_time
from tests.planning.calls import floats, raw_call

FACTS = BackendFacts()


def slow_link():
    """The copy back of a 16 KiB input takes 164 ms; each Dense backward 67 ms."""
    return DeviceProfile(name="link", description="a link", flops_per_second={"float32": 1e9},
                         elementwise_bytes_per_second=1e12, host_to_device_bytes_per_second=1e5,
                         device_to_host_bytes_per_second=1e9, host_to_device_concurrent_bytes_per_second=1e5,
                         device_to_host_concurrent_bytes_per_second=1e9)


def dense_chain(n: int = 8):
    return [raw_call(keras.layers.Dense(4096, name=f"d{i}"), [(f"t{i}", floats(4096))],
                     [(f"t{i + 1}", floats(4096))]) for i in range(n)]


def plan(config, calls):
    entries = build_plan(calls, config, FACTS)
    plan_copy_back_leads(calls, entries, config, FACTS, 1)
    return entries


def rows(entries):
    return [list(e.tensor_offloaded) for e in entries]


def test_the_waiting_call_starts_its_copy_back_earlier_without_a_higher_peak():
    # d0's and d4's inputs go to host; two calls of lead leave 30 ms of each copy back exposed. Three calls
    # ahead for every call raise the peak (both copies held at once); three for d0 alone do not, and hide its wait.
    calls = dense_chain()
    config = LMSConfig(min_bytes=0, keep_last=0, include=["d0", "d4"], prefetch=2, device_profile=slow_link())
    offloaded = [[i in (0, 4)] for i in range(len(calls))]
    assert simulate(calls, offloaded, FACTS, prefetch=3).budget_bytes > simulate(calls, offloaded, FACTS,
                                                                                    prefetch=2).budget_bytes
    entries = plan(config, calls)
    assert rows(entries) == offloaded
    leads = planned_leads(entries, config.prefetch)
    assert isinstance(leads, tuple) and leads[0] >= 3 and leads[1:] == (2,) * 7, leads
    assert entries[0].copy_back_lead == leads[0] and all(e.copy_back_lead is None for e in entries[1:])
    assert "copies back start" in entries[0].reason
    uniform = predict_step_time(calls, offloaded, FACTS, slow_link(), prefetch=2)
    led = predict_step_time(calls, offloaded, FACTS, slow_link(), prefetch=leads)
    assert uniform.call_waits[0] > 0.02 and led.call_waits[0] == 0.0
    assert led.step_seconds < uniform.step_seconds - 0.02
    assert (simulate(calls, offloaded, FACTS, prefetch=leads).budget_bytes
            == simulate(calls, offloaded, FACTS, prefetch=2).budget_bytes)


def test_with_a_budget_a_lead_never_takes_the_plan_over_it():
    calls = dense_chain()
    offloaded = [[i in (0, 4)] for i in range(len(calls))]
    budget = simulate(calls, offloaded, FACTS, prefetch=2).budget_bytes
    config = LMSConfig(min_bytes=0, keep_last=0, include=["d0", "d4"], prefetch=2, device_budget=budget,
                       device_profile=slow_link())
    entries = plan(config, calls)
    leads = planned_leads(entries, config.prefetch)
    assert simulate(calls, rows(entries), FACTS, prefetch=leads).budget_bytes <= budget


@pytest.mark.parametrize("control", ["search off", "no profile", "prefetch=0", "XLA schedules the copies"])
def test_controls_keep_one_depth(control, monkeypatch):
    calls = dense_chain()
    settings = dict(min_bytes=0, keep_last=0, include=["d0", "d4"], prefetch=2, device_profile=slow_link())
    facts = FACTS
    if control == "search off":
        monkeypatch.setattr(copy_back_leads, "COPY_BACK_LEADS", False)
    elif control == "no profile":
        settings["device_profile"] = None
    elif control == "prefetch=0":
        settings["prefetch"] = 0
    else:
        from keras_lms.offload.jax.step_memory import JaxFacts

        facts = JaxFacts()
        assert not facts.starts_copies_back_per_call
    config = LMSConfig(**settings)
    entries = build_plan(calls, config, facts)
    plan_copy_back_leads(calls, entries, config, facts, 1)
    assert all(e.copy_back_lead is None for e in entries)
    assert planned_leads(entries, config.prefetch) == config.prefetch


def test_one_depth_or_one_per_call_predict_the_same():
    calls = dense_chain()
    offloaded = [[i in (0, 4)] for i in range(len(calls))]
    for depth in (0, 1, 2, 5):
        per_call = (depth,) * len(calls)
        assert lead_of(per_call, 3) == lead_of(depth, 3) == depth and deepest_lead(per_call) == depth
        assert (predict_step_time(calls, offloaded, FACTS, slow_link(), prefetch=depth)
                == predict_step_time(calls, offloaded, FACTS, slow_link(), prefetch=per_call))
        assert (simulate(calls, offloaded, FACTS, prefetch=depth).budget_bytes
                == simulate(calls, offloaded, FACTS, prefetch=per_call).budget_bytes)
