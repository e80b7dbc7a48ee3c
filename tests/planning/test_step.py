"""`planning.plan_step`, the one planning entry point, on a third back end (tests/planning/fake_backend.py): a
module that implements the back-end contract plans a model, and the report and the wrapper run on it. Planning
asks the back end's `BackendFacts` everything that differs between frameworks; tests/test_architecture.py checks
that nothing outside keras_lms/offload/ branches on a back end's name."""

from __future__ import annotations

import keras
import pytest

import keras_lms
from keras_lms import offload, planning
from keras_lms.config import LMSConfig
from tests.planning import fake_backend


def small_model():
    inputs = keras.Input((16, 16, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(x)
    outputs = keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling2D(name="gap")(x))
    return keras.Model(inputs, outputs, name="small")


@pytest.fixture
def on_the_fake_backend(monkeypatch):
    monkeypatch.setattr(offload, "active_backend", lambda: fake_backend)
    return fake_backend


def test_the_fake_backend_satisfies_the_contract():
    assert offload.contract_problems(fake_backend) == []


def test_plan_step_plans_with_the_backends_facts():
    model = small_model()
    config = LMSConfig(min_bytes=0, keep_last=0)
    step = planning.plan_step(fake_backend, model, planning.model_structure(model), config, None, batch_size=4)
    assert [e.layer for e in step.entries] == ["conv", "relu", "pool", "conv2", "gap", "head"]
    assert step.facts is fake_backend.FACTS
    weights = planning.variable_bytes(model.variables)
    assert step.static_bytes == weights * 4 + fake_backend.FakeFacts.STATIC_EXTRA  # + grads and Adam's 2 slots
    by_layer = {e.layer: e for e in step.entries}
    # relu is differentiated from its output here: its input is not read back (nothing new on the host)
    assert by_layer["relu"].reason.startswith("offloaded: backward reads no inputs")
    assert by_layer["conv"].offloaded and by_layer["conv"].offloaded_bytes == 4 * 16 * 16 * 3 * 4
    plain, wrapped = step.plain_memory(), step.wrapped_memory()
    assert len(plain.timeline) == len(wrapped.timeline) == 2 * len(step.entries)
    assert plain.static_bytes == wrapped.static_bytes == step.static_bytes


def test_the_facts_decide_the_prediction():
    """Negative control: the same plan with one fact changed (offloaded calls not recomputed) predicts less."""
    model = small_model()
    config = LMSConfig(min_bytes=0, keep_last=0)
    structure = planning.model_structure(model)
    recomputing = planning.plan_step(fake_backend, model, structure, config, None, batch_size=4).wrapped_memory()

    class NoRecompute(fake_backend.FakeFacts):
        recomputes_offloaded_calls = False

    other = type("other_backend", (), {"trace_calls": staticmethod(fake_backend.trace_calls),
                                       "memory_facts": staticmethod(NoRecompute)})
    lean = planning.plan_step(other, model, structure, config, None, batch_size=4).wrapped_memory()
    assert lean.peak_bytes < recomputing.peak_bytes


def test_report_and_wrap_run_on_the_fake_backend(on_the_fake_backend):
    model = small_model()
    rep = keras_lms.report(model, batch_size=4, config=LMSConfig(min_bytes=0, keep_last=0))
    assert rep.totals["static_bytes"] == planning.variable_bytes(model.variables) * 4 + 12345
    assert rep.totals["host_bytes_per_step"] > 0
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    assert [e.layer for e in wrapped.plan(batch_size=4)] == [r["layer"] for r in rep.rows]
    assert wrapped.static_bytes() == rep.totals["static_bytes"]
