"""The budget planner keeps offloaded calls on the device where ``device_budget`` has room once the level sweeps
and recomputed tensors are chosen (``planning.keep_plan``, ``budget._keep_where_room``), on the plan the issue's
acceptance measures: the 3D U-Net at 448^3 in mixed_float16 with a 16 GiB budget on H100-PCIe5; and, after the keep
search, offloads small inputs so that large outputs are recomputed (``planning.source_offload``). Planning only at
those sizes (the executed graph's peaks of these plans are in docs/benchmarks.md, ``benchmarks/simulated_gpu_peak.py``
and ``benchmarks/link_traffic.py``); the pattern the move makes is run on a small U-Net against the plain model."""

import keras
import numpy as np
import pytest

import keras_lms
from benchmarks.models import unet
from keras_lms.offload.tensorflow import pooling_folds
from keras_lms.planning import budget, source_offload
from tests.oracle import compare_step

pytestmark = pytest.mark.tensorflow(reason="level sweeps and slabs, which free the room, are TensorFlow's")

KEPT = "kept: device_budget has room"


def report(model):
    return keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="h100-pcie5")


def test_room_left_by_the_sweeps_keeps_calls_whose_copies_cost_time(mixed_precision, monkeypatch):
    model = unet((448, 448, 448, 1), 16)
    # the keep search alone (the move after it, source_offload, takes some of the same room: 0.502 s in all)
    monkeypatch.setattr(source_offload, "MAX_TRIALS", 0)
    kept = report(model)
    monkeypatch.setattr(budget, "calls_to_keep", lambda *args, **kwargs: {})
    control = report(model)  # the same planner without the keep search
    names = [r["layer"] for r in kept.rows if r["reason"].startswith(KEPT)]
    assert names and not any(r["reason"].startswith(KEPT) for r in control.rows)
    assert all("ms longer on h100-pcie5" in r["reason"] for r in kept.rows if r["layer"] in names)
    assert kept.totals["budget_peak_bytes"] <= 16 << 30 and kept.totals["fits_device_budget"]
    faster, slower = kept.times["as planned"], control.times["as planned"]
    # 0.537 s against 0.548 (1.9%; 5% before the memory model charged a concatenation's reader its parts, which
    # left the planner more room before the search)
    assert faster.step_seconds < 0.99 * slower.step_seconds
    assert faster.host_to_device_bytes + faster.device_to_host_bytes < (
        slower.host_to_device_bytes + slower.device_to_host_bytes)


def test_the_budget_planner_fuses_short_chains_where_they_fit_and_save_time(mixed_precision, monkeypatch):
    """On GH200 the level-0 BatchNorms wait for their input's second read (one per backward pass). A short chain
    takes the first pass in the ReLU's backward, on the same windows (``planning.chain_plan``): at 448^3
    mixed_float16 with a 16 GiB budget the planner fuses the encoder's skip ReLUs, the plan still fits, and the
    predicted step and the bytes back fall (0.278 -> 0.267 s, 44.5 -> 41.1 GiB). The control: the same planner
    without the search fuses none (the module's SHORT_CHAINS stays off). Both without folded poolings: a skip ReLU
    that takes its pooling's gradient (``pooling_folds``, the default) is cut into the pooling's windows, which
    are not its BatchNorm's, so it forms no short chain. Here the fold, which frees the skip junction's memory
    elsewhere, is the slower choice by 0.8% (0.262 s against 0.260 with the short chains and the leads they
    leave room for): the planner does not yet weigh the two against each other."""
    model = unet((448, 448, 448, 1), 16)
    folded = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="gh200")
    monkeypatch.setattr(pooling_folds, "ENABLED", False)
    fused = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="gh200")
    assert folded.times["as planned"].step_seconds < 1.02 * fused.times["as planned"].step_seconds
    monkeypatch.setattr(budget, "plan_short_chains", lambda *args, **kwargs: None)
    control = keras_lms.report(model, batch_size=1, device_budget="16GiB", device_profile="gh200")
    short = [r for r in fused.rows if "its output recomputed from" in r["reason"]]
    assert "down0_relu2" in [r["layer"] for r in short] and all(r["decision"] == "recompute" for r in short)
    assert not any("its output recomputed from" in r["reason"] for r in control.rows)
    assert fused.totals["fits_device_budget"]
    faster, slower = fused.times["as planned"], control.times["as planned"]
    assert faster.step_seconds < 0.97 * slower.step_seconds
    assert faster.host_to_device_bytes < slower.host_to_device_bytes


def test_a_small_input_is_offloaded_so_that_the_large_output_is_recomputed(monkeypatch):
    """With room for all but a few tensors, the fewest offloads by bytes x distance are the level-0 encoder's
    convolution outputs, copied and brought back twice at the end of the backward. Their producer's input is the
    216 MiB image: offloaded, the first convolution's 3.4 GiB output is recomputed from its windows instead
    (``planning.source_offload``): at 384^3 float32 with a 64 GiB budget on H100-PCIe5, 0.455 -> 0.307 s
    predicted, 6.9 -> 0.7 GiB back. The control: the same planner without the move (no candidates), whose faster
    start is now every eligible tensor offloaded (0.440 s since a sweep's pass B stopped being charged for its own
    activation, session 30): the image is offloaded there too, but with 48 calls, not as the move."""
    model = unet((384, 384, 384, 1), 16)
    moved = keras_lms.report(model, batch_size=1, device_budget="64GiB", device_profile="h100-pcie5")
    monkeypatch.setattr(source_offload, "MAX_TRIALS", 0)
    control = keras_lms.report(model, batch_size=1, device_budget="64GiB", device_profile="h100-pcie5")
    first = {r["layer"]: r for r in moved.rows}["down0_conv1"]
    assert first["offloaded"] and "so that the output can be recomputed" in first["reason"]
    assert "its output is not copied" in first["reason"]  # the re-plan chose to recompute it
    assert "so that the output can be recomputed" not in {r["layer"]: r for r in control.rows}["down0_conv1"]["reason"]
    assert sum(r["offloaded"] for r in moved.rows) < sum(r["offloaded"] for r in control.rows)
    assert moved.totals["fits_device_budget"]
    faster, slower = moved.times["as planned"], control.times["as planned"]
    assert faster.step_seconds < 0.8 * slower.step_seconds
    assert faster.host_to_device_bytes < 0.2 * slower.host_to_device_bytes


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_an_output_recomputed_from_the_image_copy_matches_the_plain_model(dtype_policy):
    """What the move above makes run: the first convolution's input (the image) copied to host and its output
    recomputed from the copy's windows for every backward that reads it, its neighbours offloaded and the rest of
    the U-Net kept (the 64 GiB plan's pattern, chosen here by ``include``): exact in float64 against the plain
    model, loss, outputs, every gradient and the BatchNorm statistics."""
    keras.utils.set_random_seed(0)
    model = unet((64, 64, 1), 8, levels=3)
    wrapped = keras_lms.wrap(model, include=["down0_conv1", "down0_bn1", "down0_relu1", "down0_conv2"],
                             min_bytes=0, keep_last=0, slab_bytes="8KiB", device_profile="h100-pcie5")
    plan = wrapped.plan(batch_size=2)
    assert plan[0].layer == "down0_conv1" and plan[0].offloaded and plan[0].recomputed_output
    assert not any(e.offloaded for e in plan[4:])
    result = compare_step(model, wrapped, np.random.default_rng(0).random((2, 64, 64, 1)))
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result
