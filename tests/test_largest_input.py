"""`keras_lms.largest_input` and `keras-lms largest`: the answer is what the planner accepts and the next shape is
what it refuses (asked independently through `keras_lms.report`), the wrapped model trains at the answer, the
search converges in few probes, and bad arguments get one message naming the fix (every back end). What the
answer does on the executed graph: tests/offload/tensorflow/test_simulated_peak.py."""

import json
import logging
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.largest_input import _Search
from tests import models

CONFIG = keras_lms.LMSConfig(min_bytes="16KiB")  # (the small U-Net's tensors are below wrap's default min_bytes)
BUDGET = "2MiB"


def _compiled_unet(size=None):
    """The small U-Net compiled with the optimizer the test trains with, built: the plan counts its state (an
    unbuilt optimizer's is assumed, and a step at the budget's edge would be judged by another state)."""
    model = models.unet2d(size=size)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def found():
    return keras_lms.largest_input(_compiled_unet(), batch_size=2, device_budget=BUDGET, input_shape=(32, 32, 1),
                                   config=CONFIG)


def test_the_answer_fits_and_the_next_rung_does_not(found):
    """Measured: 92x92 fits 2 MiB (plain Keras: 64x64); 96x96 is refused (2.0 MiB with the margin)."""
    model = _compiled_unet()
    assert found.multiple == 4  # (two poolings: the model's down-sampling, inferred)
    assert found.input_shape[0] % 4 == 0 and found.input_shape[0] == found.input_shape[1]
    assert found.refused_shape == (found.input_shape[0] + 4, found.input_shape[1] + 4, 1)  # adjacent rungs
    answer = keras_lms.report(model, 2, input_shape=found.input_shape, device_budget=BUDGET, config=CONFIG)
    assert answer.totals["fits_device_budget"]
    try:
        refused = keras_lms.report(model, 2, input_shape=found.refused_shape, device_budget=BUDGET, config=CONFIG)
    except keras_lms.BudgetError:
        pass
    else:
        assert not refused.totals["fits_device_budget"], refused.totals
    assert found.refused_because
    # plain Keras, by the same rule: its predicted peak with the planner's margin
    budget = keras_lms.config.parse_bytes(BUDGET, "budget")
    plain = found.plain_input_shape
    assert plain is not None and plain[0] < found.input_shape[0]
    assert keras_lms.report(model, 2, input_shape=plain, config=CONFIG).plain.budget_bytes <= budget
    bigger = (plain[0] + 4, plain[1] + 4, 1)
    assert keras_lms.report(model, 2, input_shape=bigger, config=CONFIG).plain.budget_bytes > budget


def test_the_wrapped_model_trains_at_the_answer_without_a_warning(found, caplog):
    model = _compiled_unet(found.input_shape[0])  # (torch's wrap plans at construction: a known size)
    wrapped = keras_lms.wrap(model, device_budget=BUDGET, min_bytes=CONFIG.min_bytes)
    wrapped.compile(optimizer="sgd", loss="binary_crossentropy")
    wrapped.optimizer.build(wrapped.trainable_variables)  # (the state the answer was planned with)
    x = np.random.default_rng(0).random((2, *found.input_shape)).astype("float32")
    y = (x > 0.5).astype("float32")
    with caplog.at_level(logging.WARNING, logger="keras_lms"):
        history = wrapped.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert not [r for r in caplog.records if "margin" in r.getMessage()], caplog.text
    assert any(e.offloaded for e in wrapped.lms_plan)  # (the answer needs offload: plain fits only 64x64)
    # control: one rung larger, training at batch 2 refuses the budget or plans it only without the margin,
    # with that warning
    caplog.clear()
    larger = keras_lms.wrap(_compiled_unet(found.refused_shape[0]), device_budget=BUDGET,
                            min_bytes=CONFIG.min_bytes)
    larger.compile(optimizer="sgd", loss="binary_crossentropy")
    larger.optimizer.build(larger.trainable_variables)
    x = np.zeros((2, *found.refused_shape), "float32")
    with caplog.at_level(logging.WARNING, logger="keras_lms"):
        try:
            larger.fit(x, x, batch_size=2, epochs=1, verbose=0)
        except keras_lms.BudgetError:
            return
    assert [r for r in caplog.records if "margin" in r.getMessage()], caplog.text


def test_the_result_prints_and_serialises(found):
    text = found.to_text()
    shape, plain = ("x".join(map(str, s)) for s in (found.input_shape, found.plain_input_shape))
    assert f"Largest input that fits 2.0 MiB: {shape} (plain Keras: {plain})." in text
    assert all("x".join(map(str, p.input_shape)) in text for p in found.probes)
    data = json.loads(json.dumps(found.to_dict()))
    assert data["input_shape"] == list(found.input_shape) and len(data["probes"]) == len(found.probes)
    assert [tuple(p["input_shape"]) for p in data["probes"] if p["fits"]][-1] <= tuple(found.input_shape)


def test_a_model_built_for_one_size_is_searched_through_a_clone(found):
    """A model whose input fixes its sizes (as a saved model usually does) refuses every other size; the search
    probes a clone with the grown axes open, compiled with its optimizer, and finds what the open model finds,
    wrapped too (with the wrapped model's settings)."""
    fixed = keras_lms.largest_input(_compiled_unet(32), batch_size=2, device_budget=BUDGET, config=CONFIG)
    assert fixed.input_shape == found.input_shape and fixed.plain_input_shape == found.plain_input_shape
    wrapped = keras_lms.wrap(_compiled_unet(32), min_bytes=CONFIG.min_bytes)
    wrapped.compile(optimizer="sgd", loss="binary_crossentropy")
    wrapped.optimizer.build(wrapped.trainable_variables)
    assert keras_lms.largest_input(wrapped, batch_size=2, device_budget=BUDGET).input_shape == found.input_shape


def test_the_search_doubles_then_bisects():
    """On a ladder with a known boundary (rung 37), with a counting oracle: the answer, in at most
    2 * log2(boundary) + 2 questions; a first rung that does not fit bisects down; nothing fits: 0."""
    search = _Search(None, 1, 1 << 30, (64, 128, 3), (0, 1), 16, None, None, None)
    asked = []

    def fits_below(boundary):
        return lambda k: asked.append(k) or k <= boundary

    assert search.first == 4 and search.shape(4) == (64, 128, 3) and search.shape(5) == (80, 160, 3)
    assert search.largest(fits_below(37)) == 37 and len(asked) <= 2 * 6 + 2, asked
    assert search.largest(fits_below(2)) == 2
    assert search.largest(fits_below(0)) == 0
    asked.clear()
    assert search.largest(fits_below(1000), within=12) == 12 and asked == [12]  # within a known answer: as is


def test_nothing_fits_says_why():
    result = keras_lms.largest_input(models.unet2d(size=None), batch_size=2, device_budget="64KiB",
                                     input_shape=(32, 32, 1), config=CONFIG, plain=False)
    assert result.input_shape is None and result.report is None and result.plain_input_shape is None
    assert result.refused_because and "No input fits" in result.to_text()


def _two_inputs():
    a, b = keras.Input((8, 8, 1)), keras.Input((8, 8, 1))
    return keras.Model([a, b], keras.layers.Conv2D(1, 3, padding="same")(keras.layers.Add()([a, b])))


@pytest.mark.parametrize("model,kwargs,exc,pattern", [
    ("unet", dict(axes=(0, 3)), ValueError, "axes must be distinct sample axes"),
    ("unet", dict(axes=(0, 0)), ValueError, "axes must be distinct sample axes"),
    ("unet", dict(multiple=0), ValueError, "multiple must be a positive integer"),
    ("unet", dict(input_shape=(32, 0, 1)), ValueError, "input_shape must be one sample's shape"),
    ("unet", dict(input_shape=None), ValueError, "give largest_input a start shape"),
    ("unet", dict(multiple=3), ValueError, "does not build at input shape .* multiple="),
    ("unet", dict(device_budget="lots"), ValueError, "device_budget"),
    ("unet", dict(device_budget="0MiB"), ValueError, "device_budget must be positive"),
    ("unet", dict(batch_size=0), ValueError, "batch_size must be a positive integer"),
    ("unet", dict(device_profile="h100-pcie9"), ValueError, "h100-pcie9"),
    ("unet", dict(config={"min_bytes": 0}), TypeError, "config must be a keras_lms.LMSConfig"),
    ("unet", dict(on_probe=3), TypeError, "on_probe must be a function"),
    ("two", dict(), ValueError, "largest_input grows one input"),
    ("none", dict(), TypeError, "expects a keras.Model"),
])
def test_bad_arguments_get_one_message_naming_the_fix(model, kwargs, exc, pattern):
    built = {"unet": lambda: models.unet2d(size=None), "two": _two_inputs, "none": lambda: "model.keras"}[model]()
    arguments = dict(batch_size=2, device_budget=BUDGET, input_shape=(32, 32, 1), config=CONFIG, plain=False)
    with pytest.raises(exc, match=pattern):
        keras_lms.largest_input(built, **{**arguments, **kwargs})


def test_cli_largest(tmp_path):
    path = tmp_path / "unet.keras"
    models.unet2d(size=None).save(path)
    cmd = [sys.executable, "-m", "keras_lms.cli", "largest", str(path), "--batch-size", "2", "--input-shape",
           "32,32,1"]
    out = subprocess.run(cmd + ["--budget", "64MiB", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["input_shape"][0] >= 32 and data["refused_shape"][0] == data["input_shape"][0] + 4
    table = subprocess.run(cmd + ["--budget", "64MiB", "--device", "h100-pcie5", "--no-plain"], capture_output=True,
                           text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "Largest input that fits 64.0 MiB" in table.stdout and "Predicted step on h100-pcie5" in table.stdout
    assert "fits" in table.stderr  # (progress, one line per probe)
    none = subprocess.run(cmd + ["--budget", "1KiB"], capture_output=True, text=True, timeout=300)
    assert none.returncode == 1 and "No input fits" in none.stdout
    bad = subprocess.run(cmd + ["--budget", "64MiB", "--axes", "x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--axes 'x' is not a list of axes" in bad.stderr


@pytest.mark.tensorflow(reason="the benchmark's table is TensorFlow's (docs/benchmarks.md); one back end suffices")
def test_the_benchmark_prints_its_table(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/largest_input.py", "--budgets", "256MiB", "--policies",
                          "float32", "--start", "32", "--json", str(tmp_path / "rows.json")], capture_output=True,
                         text=True, timeout=300, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 1 and rows[0]["input_shape"][0] == 64 and rows[0]["plain_input_shape"][0] == 32, rows
    assert "largest input that fits" in out.stdout and "64^3" in out.stdout
