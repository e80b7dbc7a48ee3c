"""A budget the budget planner's starts refuse (``budget._plan_at_the_edge``), at the cubes the issue's acceptance
measures: the 3D U-Net at 400^3 float32 and 496^3 mixed_float16 (the largest that fit 16 GiB) with a 16 GiB budget.
The starts (every eligible tensor offloaded, simulated before any level sweep) refused both, although ``wrap``'s
defaults (no budget) run there (their executed peaks: ``benchmarks/simulated_gpu_peak.py --cube-edges 400``,
docs/benchmarks.md). Now a budget the finished defaults meet with the planner's margin gets the budget's plan
finished from them (496^3 mixed_float16 on H100-PCIe5: the skip poolings' gradients in the sweeps make it fit);
one they meet only without the margin gets the defaults' plan. Planning only at those sizes."""

import pytest

import keras_lms
from benchmarks.models import unet
from keras_lms.planning import budget

pytestmark = pytest.mark.tensorflow(reason="slabs and sweeps, whose plans these are, are TensorFlow's")


def same_plan(a, b):
    return [(r["layer"], r["decision"], r["offloaded"]) for r in a.rows] == [
        (r["layer"], r["decision"], r["offloaded"]) for r in b.rows]


def refuse_as_before(monkeypatch):
    """The control: the planner before, which refused what its starts refused."""
    monkeypatch.setattr(budget, "_plan_at_the_edge", lambda *args: (_ for _ in ()).throw(args[-1]))


@pytest.mark.parametrize("profile", ["h100-pcie5", None])
def test_the_largest_float32_cube_gets_the_defaults_plan(profile, monkeypatch):
    model = unet((400, 400, 400, 1), 16)
    defaults = keras_lms.report(model, batch_size=1, device_profile=profile)
    planned = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile=profile)
    assert not planned.totals["fits_device_budget"] and planned.totals["fits_device_budget_without_margin"]
    assert same_plan(planned, defaults)
    assert planned.totals["predicted_peak_bytes_wrapped"] == defaults.totals["predicted_peak_bytes_wrapped"]
    assert any("met only without the planner's margin" in r["reason"] for r in planned.rows)
    assert "without the planner's margin only" in planned.to_text(max_rows=0)
    refuse_as_before(monkeypatch)
    with pytest.raises(keras_lms.BudgetError):
        keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile=profile)


def test_the_largest_mixed_precision_cube_gets_a_budget_plan_from_the_defaults(mixed_precision, monkeypatch):
    model = unet((496, 496, 496, 1), 16)
    defaults = keras_lms.report(model, batch_size=1, device_profile="h100-pcie5")
    planned = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="h100-pcie5")
    assert planned.totals["fits_device_budget"]  # with the margin: 13.9 GiB predicted (the defaults: 12.0)
    # 2.39x the plain step against the defaults' 2.89x
    assert planned.times["as planned"].step_seconds < 0.9 * defaults.times["as planned"].step_seconds
    refuse_as_before(monkeypatch)
    with pytest.raises(keras_lms.BudgetError):
        keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="h100-pcie5")


def test_a_budget_below_what_the_defaults_need_is_still_refused():
    model = unet((400, 400, 400, 1), 16)
    with pytest.raises(keras_lms.BudgetError, match="cannot be met"):  # (the defaults: 14.9 GiB predicted)
        keras_lms.report(model, batch_size=1, device_budget="14GiB", device_profile="h100-pcie5")
