"""The per-call rules (min_bytes, keep_last, include/exclude) and the plan entries they become, on hand-built
calls (no tracing)."""

from __future__ import annotations

import keras
import pytest

from keras_lms.config import LMSConfig
from keras_lms.planning import BackendFacts, plan, rules
from tests.planning.calls import floats, raw_call


def chain():
    return [raw_call(keras.layers.Dense(8, name=f"d{i}"), [(f"t{i}", floats(256))], [(f"t{i + 1}", floats(256))])
            for i in range(4)]


def test_keep_last_and_min_bytes():
    decisions = rules.decide_all(chain(), LMSConfig(min_bytes=1024, keep_last=1), batch_size=1)
    assert [d.offloaded for d in decisions] == [True, True, True, False]
    assert decisions[3].reason == "kept: among the last 1 layer call(s) (keep_last)"
    small = rules.decide_all(chain(), LMSConfig(min_bytes=2048, keep_last=0), batch_size=1)
    assert not any(d.offloaded for d in small) and "< min_bytes 2.0 KiB" in small[0].reason
    assert all(d.offloaded for d in rules.decide_all(chain(), LMSConfig(min_bytes=2048, keep_last=0), batch_size=2))


def test_include_exclude_and_unoffloadable():
    calls = chain()
    calls[1] = raw_call(calls[1].unit, [("t1", floats(256))], [("t2", floats(256))], offloadable="quantized")
    decisions = rules.decide_all(calls, LMSConfig(min_bytes=0, keep_last=0, exclude=["d2"]), batch_size=1)
    assert [d.reason.split(":")[0] for d in decisions] == ["offloaded", "kept", "kept", "offloaded"]
    assert decisions[1].reason == "kept: quantized" and decisions[2].reason == "kept: excluded by exclude="
    only = rules.decide_all(calls, LMSConfig(min_bytes=0, keep_last=0, include=[keras.layers.Dense]), batch_size=1)
    assert [d.offloaded for d in only] == [True, False, True, True]
    with pytest.raises(ValueError, match="unknown layer"):
        rules.check_selector_names(LMSConfig(include=["d9"]), {"d0", "d1"})


def test_a_shared_tensor_is_copied_to_the_host_once():
    add = keras.layers.Add(name="add")
    concat_reader = keras.layers.Dense(4, name="reader")
    calls = [raw_call(keras.layers.Dense(8, name="a"), [("x", floats(64))], [("s", floats(64))]),
             raw_call(concat_reader, [("s", floats(64))], [("r", floats(64))]),
             raw_call(add, [("s", floats(64)), ("r", floats(64))], [("o", floats(64))])]
    decisions = rules.decide_all(calls, LMSConfig(min_bytes=0, keep_last=0), batch_size=1)
    entries = plan.plan_entries(calls, decisions, BackendFacts(), batch_size=1)
    assert [e.new_host_bytes for e in entries] == [256, 256, 0]  # Add reads no values: nothing read back
    assert entries[2].reason == "offloaded: backward reads no inputs (output host copy or shapes only)"
    assert plan.host_bytes_per_step(entries) == 512


def test_tensor_bytes():
    assert plan.tensor_bytes([None, 4, None], "float16", batch_size=3) == 3 * 4 * 1 * 2
    assert plan.tensor_bytes([2, 2], "bfloat16") == 8
