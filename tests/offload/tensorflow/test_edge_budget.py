"""A budget met only without the planner's margin (``budget._plan_at_the_edge``), at the cubes the issue's
acceptance measures: the 3D U-Net at 400^3 float32 and 496^3 mixed_float16 (the largest that fit 16 GiB) with a
16 GiB budget. The margin refused both, although ``wrap``'s defaults (no budget) run there (their executed peaks:
``benchmarks/simulated_gpu_peak.py --cube-edges 400``, docs/benchmarks.md); now the budget gets that plan. Planning
only at those sizes."""

import pytest

import keras_lms
from benchmarks.models import unet
from keras_lms.planning import budget

pytestmark = pytest.mark.tensorflow(reason="slabs and sweeps, whose plans these are, are TensorFlow's")


def same_plan(a, b):
    return [(r["layer"], r["decision"], r["offloaded"]) for r in a.rows] == [
        (r["layer"], r["decision"], r["offloaded"]) for r in b.rows]


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
    monkeypatch.setattr(budget, "_plan_at_the_edge", lambda *args: (_ for _ in ()).throw(args[-1]))
    with pytest.raises(keras_lms.BudgetError):  # the control: the planner before refused the budget
        keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile=profile)


def test_the_largest_mixed_precision_cube_gets_the_defaults_plan(mixed_precision):
    model = unet((496, 496, 496, 1), 16)
    defaults = keras_lms.report(model, batch_size=1, device_profile="h100-pcie5")
    planned = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="h100-pcie5")
    assert planned.totals["fits_device_budget_without_margin"] and same_plan(planned, defaults)


def test_a_budget_below_what_the_defaults_need_is_still_refused():
    model = unet((400, 400, 400, 1), 16)
    with pytest.raises(keras_lms.BudgetError, match="cannot be met"):
        keras_lms.report(model, batch_size=1, device_budget="15GiB", device_profile="h100-pcie5")
