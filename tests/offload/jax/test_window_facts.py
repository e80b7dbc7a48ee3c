"""The planner's facts of the JAX step's windows (``keras_lms/offload/jax/window_facts.py``): which calls run in
windows, which skips are parked on host, which concatenations are never built, and that ``device_budget``
accepts the 3D U-Net cube the wrapped model trains (it refused it while the report knew no windows).

The compiled programs these facts are calibrated on are in tests/offload/jax/test_compiled_offload.py."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import keras  # noqa: E402

import keras_lms  # noqa: E402
from benchmarks.models import unet  # noqa: E402
from keras_lms import memory as lms_memory  # noqa: E402
from keras_lms.offload.jax import parking, step_memory  # noqa: E402

pytestmark = pytest.mark.jax
COMPILED_416 = 13.47 * 2**30  # benchmarks/jax_compiled_memory.py --max-cube --variants wrap --cube-range 416,416


def _planned(model, batch_size=2, **options):
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, **options)
    wrapped.compile(optimizer="adam", loss="mse")
    return wrapped, keras_lms.report(wrapped, batch_size=batch_size).totals


def test_skips_are_parked_after_their_pooling_and_their_concatenations_never_built(monkeypatch):
    """With slabs of 1 KiB every decoder convolution over a concatenation runs in windows: each skip is parked
    after its first reader (the pooling) and its concatenation is elided from the predicted peak. Control:
    parking switched off, nothing is parked."""
    keras.utils.set_random_seed(0)
    wrapped, _ = _planned(unet((16, 16, 16, 1), 4, levels=2), slab_bytes="1KiB")
    parked = {e.layer: e.parked_inputs for e in wrapped.lms_plan if e.parked_inputs}
    assert parked == {"down0_pool": [0], "down1_pool": [0]}, parked
    monkeypatch.setattr(parking, "PARKED", False)
    keras.utils.set_random_seed(0)
    control, _ = _planned(unet((16, 16, 16, 1), 4, levels=2), slab_bytes="1KiB")
    assert not any(e.parked_inputs for e in control.lms_plan)


def test_the_windows_lower_the_predicted_peak_only_where_operands_exceed_a_slab(monkeypatch):
    """The same U-Net: its predicted peak with windows is lower than without the window facts; at the default
    slab size no operand is that large and the prediction is the same either way."""
    def predicted(slab_bytes, facts: bool):
        if not facts:
            monkeypatch.setattr(step_memory.JaxFacts, "slab_plans", lambda *_: {})
        try:
            keras.utils.set_random_seed(0)
            return _planned(unet((32, 32, 32, 1), 8, levels=2), slab_bytes=slab_bytes)[1][
                "predicted_peak_bytes_wrapped"]
        finally:
            monkeypatch.undo()

    assert predicted("16KiB", True) < 0.9 * predicted("16KiB", False)
    assert predicted("256MiB", True) == predicted("256MiB", False)


@pytest.mark.slow
def test_device_budget_accepts_a_cube_that_trains(monkeypatch):
    """The 3D U-Net of the largest-cube search at 416^3 float32 compiles to 13.47 GiB (temp + arguments) on the
    H100 program (docs/benchmarks.md); ``device_budget="16GiB"`` plans it (the report: 13.49 GiB, 15% more with
    the planner's margin). Control: without the window facts the report counts every windowed call's
    operands whole, and the budget refuses the cube."""
    monkeypatch.setattr(lms_memory, "host_available_bytes", lambda: 1 << 40)  # a GPU server's host
    wrapped = keras_lms.wrap(unet((416, 416, 416, 1), 16), min_bytes="256KiB", keep_last=0, device_budget="16GiB")
    wrapped.compile(optimizer="adam", loss="mse")
    peak = keras_lms.report(wrapped, batch_size=1).totals["predicted_peak_bytes_wrapped"]
    assert abs(peak - COMPILED_416) < 0.15 * COMPILED_416, peak / 2**30
    monkeypatch.setattr(step_memory.JaxFacts, "slab_plans", lambda *_: {})
    with pytest.raises(keras_lms.BudgetError):
        keras_lms.wrap(unet((416, 416, 416, 1), 16), min_bytes="256KiB", keep_last=0, device_budget="16GiB")
