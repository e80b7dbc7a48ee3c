"""Planning time: the facts of a whole call list derived once per list (``plan.derived_from_calls``), and the
planning-time benchmark (``benchmarks/planning_time.py``)."""

import json
import pathlib
import subprocess
import sys

import pytest

import keras_lms
from benchmarks.models import unet
from keras_lms.offload.tensorflow import slab_costs
from keras_lms.planning import plan as plan_module

pytestmark = pytest.mark.tensorflow(reason="the concatenation parts are the TensorFlow slab model's")

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _planned(model):
    rep = keras_lms.report(model, batch_size=1, device_budget="160MiB", device_profile="h100-pcie5")
    return [(r["layer"], r["decision"], r["reason"]) for r in rep.rows], rep.times["as planned"].step_seconds


def test_a_call_lists_concatenation_parts_are_derived_once_and_plan_the_same(monkeypatch):
    """The time-aware budget plan of a 3D U-Net asks for the concatenation parts per slab call per predicted step;
    they are computed once per traced call list (a few lists: the trace, the report's plain count). Control: with
    nothing kept (every question computes) the same plan, from hundreds of computations."""
    model = unet((64, 64, 64, 1), 8)
    computed = []
    real = slab_costs._concatenation_parts
    monkeypatch.setattr(slab_costs, "_concatenation_parts",
                        lambda calls, batch_size: computed.append(1) or real(calls, batch_size))
    kept = _planned(model)
    once = len(computed)
    assert 1 <= once <= 4, once
    computed.clear()
    monkeypatch.setattr(slab_costs, "derived_from_calls", lambda calls, name, compute, *key: compute())
    assert _planned(model) == kept
    assert len(computed) > 50 * once, len(computed)


def test_derived_facts_are_kept_per_list_and_key():
    """The same list and key: one computation; another key, or a list with another call: computed again; lists
    whose calls keep nothing (no ``derived``) compute every time; at most ``DERIVED_LISTS`` lists are kept (or
    ``limit``)."""
    calls = [plan_module.RawCall(object(), [], [], [], [], [], [], [], None) for _ in range(3)]
    computed = []

    def ask(cs, *key):
        return plan_module.derived_from_calls(cs, "fact", lambda: computed.append(key) or len(computed), *key)

    assert ask(calls, 1) == ask(calls, 1) == 1 and len(computed) == 1
    assert ask(calls, 2) == 2
    other = calls[:2] + [plan_module.RawCall(object(), [], [], [], [], [], [], [], None)]
    assert ask(other, 1) == 3 and ask(calls, 1) == 1
    plain = [object(), object()]
    assert ask(plain, 1) == 4 and ask(plain, 1) == 5
    for key in range(plan_module.DERIVED_LISTS + 1):
        ask(calls, "k", key)
    assert len(calls[0].derived["fact"]) == plan_module.DERIVED_LISTS
    for key in range(3):  # (a fact kept for more lists, as the slab plans: its own limit)
        plan_module.derived_from_calls(calls, "limited", lambda: 0, key, limit=2)
    assert list(calls[0].derived["limited"]) == [(tuple(map(id, calls)), 1), (tuple(map(id, calls)), 2)]


def test_the_planning_time_benchmark_prints_its_table(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/planning_time.py", "--smoke", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["profile"] for r in rows] == ["-", "h100-pcie5"] and all(r["seconds"] > 0 for r in rows)
    assert rows[1]["step_seconds"] >= rows[1]["plain_seconds"] > 0 and rows[0]["calls"] == rows[1]["calls"] > 100
    assert "planning time of wrap" in out.stdout
