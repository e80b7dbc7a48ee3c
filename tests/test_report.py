"""Activation report, budget planner and host-memory guard (the keras-lms command: tests/test_cli.py)."""

import json

import keras
import numpy as np
import pytest
from PIL import Image

import keras_lms
from benchmarks.models import build_unet
from keras_lms import memory
from tests import models
from tests.oracle import assert_matches


def dense_chain():
    inp = keras.Input((8,))
    return keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16)(inp)), name="dense_chain")


def shared_tensor():
    inp = keras.Input((4, 4, 1))
    x = keras.layers.Conv2D(2, 1)(inp)
    a, b = keras.layers.Conv2D(2, 1)(x), keras.layers.Conv2D(2, 1)(x)
    return keras.Model(inp, keras.layers.Add()([a, b]), name="shared_tensor")


def test_totals_match_hand_computation():
    rep = keras_lms.report(dense_chain(), batch_size=2, config=keras_lms.LMSConfig(min_bytes=0, keep_last=1))
    # call 0: Dense(16) reads 2x8 float32 = 64 B (offloaded); call 1: Dense(4) reads 2x16 = 128 B (kept).
    assert [r["input_bytes"] for r in rep.rows] == [64, 128]
    assert [r["output_bytes"] for r in rep.rows] == [128, 32]
    assert [r["offloaded"] for r in rep.rows] == [True, False]
    t = rep.totals
    assert t["device_activation_bytes_plain"] == 192
    assert t["device_activation_bytes_wrapped"] == 128
    assert t["host_bytes_per_step"] == 64
    assert t["transfer_bytes_per_step"] == 128  # 64 out + 64 back
    weights = (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert t["static_bytes"] == weights * 4  # weights + gradients + 2 Adam slots
    assert t["transfer_seconds_per_step"] == pytest.approx(128 / 16e9)


def test_shared_tensor_is_counted_once_on_host_and_twice_on_the_way_back():
    rep = keras_lms.report(shared_tensor(), batch_size=1, config=keras_lms.LMSConfig(min_bytes=0, keep_last=1))
    # conv0 reads 16 floats (64 B); its 4x4x2 output (128 B) feeds conv_a and conv_b; Add (kept) reads 2 x 128 B.
    assert [r["input_bytes"] for r in rep.rows] == [64, 128, 128, 256]
    t = rep.totals
    assert t["host_bytes_per_step"] == 64 + 128
    assert t["transfer_bytes_per_step"] == (64 + 128) + (64 + 128 + 128)
    # Add's gradient reads no tensor values, so its inputs are not kept for the backward pass at all.
    assert t["device_activation_bytes_plain"] == 64 + 128
    assert t["device_activation_bytes_wrapped"] == 0


def test_report_text_json_and_plot(tmp_path):
    rep = keras_lms.report(models.unet2d(), batch_size=4, device_budget="64MiB")
    text = rep.to_text()
    assert "activation report" in text and "predicted device peak" in text and "device budget" in text
    data = json.loads(rep.to_json())
    assert data["totals"] == rep.totals and len(data["rows"]) == len(rep.rows)
    path = rep.plot(tmp_path / "report.png")
    with Image.open(path) as img:
        assert img.size == (900, 450)


def test_report_of_wrapped_uses_its_settings_and_input_shape_override():
    wrapped = keras_lms.wrap(build_unet((None, None, 1), depth=2, base_filters=4), min_bytes=0, keep_last=0)
    rep = keras_lms.report(wrapped, batch_size=2, input_shape=(32, 32, 1))
    assert all(r["offloaded"] for r in rep.rows)
    big = keras_lms.report(wrapped, batch_size=2, input_shape=(64, 64, 1))
    assert big.totals["host_bytes_per_step"] == pytest.approx(4 * rep.totals["host_bytes_per_step"], rel=0.01)


def test_planner_offloads_nothing_when_the_step_fits():
    wrapped = keras_lms.wrap(models.unet2d(), device_budget="4GiB", min_bytes=0)
    plan = wrapped.plan(batch_size=2)
    assert not any(e.offloaded for e in plan)
    assert all("LMS not needed" in e.reason for e in plan)


def test_planner_offloads_largest_longest_lived_first_to_fit():
    model = build_unet((64, 64, 64, 1), depth=3, base_filters=8)
    plain = keras_lms.report(model, batch_size=2, config=keras_lms.LMSConfig(min_bytes=0))
    full = plain.totals["predicted_peak_bytes_wrapped"]
    budget = (plain.totals["predicted_peak_bytes_plain"] + full) // 2
    wrapped = keras_lms.wrap(model, min_bytes=0, device_budget=budget)
    plan = wrapped.plan(batch_size=2)
    chosen = [e for e in plan if e.offloaded]
    assert 0 < len(chosen) < sum(1 for e in plain.rows if e["offloaded"])
    rep = keras_lms.report(wrapped, batch_size=2)
    assert rep.totals["predicted_peak_bytes_wrapped"] <= budget
    # The first offloaded calls are early, large ones (long-lived): the first full-resolution block.
    assert min(e.index for e in chosen) <= 3
    assert not plan[-1].offloaded


def test_planner_refuses_an_impossible_budget_naming_the_largest_layer():
    model = build_unet((64, 64, 64, 1), depth=3, base_filters=8)
    with pytest.raises(keras_lms.BudgetError, match="largest single layer call is 'up0_concat'|largest single layer"):
        keras_lms.wrap(model, min_bytes=0, device_budget="40MiB").plan(batch_size=2)


def test_wrapped_with_budget_still_matches_plain():
    model = models.unet2d()
    x = np.random.default_rng(0).random((4, 32, 32, 1)).astype("float32")
    rep = keras_lms.report(model, batch_size=4, config=keras_lms.LMSConfig(min_bytes=0))
    budget = (rep.totals["predicted_peak_bytes_plain"] + rep.totals["predicted_peak_bytes_wrapped"]) // 2
    wrapped = keras_lms.wrap(model, min_bytes=0, device_budget=budget)
    assert_matches(model, wrapped, x)
    assert 0 < sum(e.offloaded for e in wrapped.lms_plan) < len(wrapped.lms_plan)


def test_host_memory_guard(monkeypatch):
    wrapped = keras_lms.wrap(models.unet2d(), min_bytes=0)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 20)  # pretend 1 MiB of free RAM
    x = np.zeros((16, 32, 32, 1), "float32")
    with pytest.raises(memory.HostMemoryError, match="host memory per step.*only 1.0 MiB of RAM is available"):
        wrapped(x, training=True)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 40)
    wrapped(x, training=True)


def test_uncalled_sequential_with_input_is_reported_and_planned():
    """``model.input`` raises on a Sequential built with keras.Input that was never called; its inputs are known."""
    model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(8, 3, padding="same"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
    rep = keras_lms.report(model, batch_size=4)
    assert rep.rows and rep.totals["predicted_peak_bytes_plain"] > 0
    wrapped = keras_lms.wrap(model, min_bytes=0, device_budget="1GiB")
    assert wrapped.lms_plan


def test_report_predicts_step_times_on_a_device_profile():
    model = models.unet2d()
    rep = keras_lms.report(model, batch_size=4, config=keras_lms.LMSConfig(min_bytes=0, keep_last=0),
                           device_profile="h100-pcie5")
    t = rep.totals
    assert t["device_profile"] == "h100-pcie5"
    # recompute-all where the back end can recompute a tensor of this plan (torch: the ReLUs after BatchNorms)
    assert {"plain", "as planned", "offload-only"} <= set(rep.times) <= {"plain", "as planned", "offload-only",
                                                                           "recompute-all"}
    plain, planned = rep.times["plain"], rep.times["as planned"]
    assert plain.exposed_seconds == 0 and plain.device_to_host_bytes == 0 and plain.host_to_device_bytes == 0
    assert t["predicted_step_seconds"] == planned.step_seconds >= plain.step_seconds
    assert plain.step_seconds == t["predicted_step_seconds_plain"]
    assert planned.step_seconds == pytest.approx(planned.compute_seconds + planned.recompute_seconds
                                                 + planned.exposed_seconds)
    # the traffic the times use is the report's
    assert planned.device_to_host_bytes == t["device_to_host_bytes_per_step"]
    assert planned.host_to_device_bytes == t["host_to_device_bytes_per_step"]
    assert sum(r["device_to_host_bytes"] + r["host_to_device_bytes"] for r in rep.rows) == t["transfer_bytes_per_step"]
    assert {r["decision"] for r in rep.rows} <= {"keep", "copy", "copy+recompute"}
    assert "predicted step time (ms) on h100-pcie5" in rep.to_text()
    # call by call: where the exposed copy time and the recompute are
    assert sum(r["predicted_wait_seconds"] for r in rep.rows) == pytest.approx(planned.exposed_seconds)
    assert sum(r["predicted_recompute_seconds"] for r in rep.rows) == pytest.approx(planned.recompute_seconds)
    assert any(r["predicted_wait_seconds"] > 0 for r in rep.rows)
    assert "waits ms" in rep.to_text() and "waits ms" not in keras_lms.report(model, batch_size=4).to_text()
    data = json.loads(rep.to_json())
    assert data["times"]["as planned"]["step_seconds"] == planned.step_seconds
    assert data["device_profile"]["name"] == "h100-pcie5"
    # a faster link can only shorten the step; GH200's link hides far more of it
    gh200 = keras_lms.report(model, batch_size=4, config=keras_lms.LMSConfig(min_bytes=0, keep_last=0),
                             device_profile="gh200")
    assert gh200.times["as planned"].exposed_seconds < planned.exposed_seconds
    without = keras_lms.report(model, batch_size=4)
    assert without.times == {} and "predicted_step_seconds" not in without.totals


def test_report_refuses_a_bad_device_profile():
    with pytest.raises(ValueError, match="neither a built-in profile"):
        keras_lms.report(dense_chain(), batch_size=2, device_profile="tpu-v9")
