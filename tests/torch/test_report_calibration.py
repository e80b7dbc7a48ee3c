"""The report's torch memory model against what a torch step really allocates (issue 15, item 3).

The oracle is the live-storage peak of one ``train_on_batch`` with Python's cyclic collector off
(benchmarks/torch_cpu_peak.py's dispatch-mode tracker; host buffers counted apart). The report predicts the same
quantity (``predicted_step_bytes``: gradients plus the larger of the activation peak and the optimizer update's
temporaries) for the plain and the wrapped model; both must agree within 15%, and the measured saving must be at
least what the report promises. The negative control shows the tolerance discriminates: the TensorFlow-calibrated
model of a plain step (every intermediate freed after its last use) misses the torch plain peak by far more.
"""

import keras
import pytest

import keras_lms
from benchmarks.models import build_unet
from benchmarks.torch_cpu_peak import dense_chain, measure, predicted_step_bytes
from keras_lms import planner
from keras_lms.offload import torch as lms_torch

pytestmark = pytest.mark.torch

TOLERANCE = 0.15

CASES = {
    "unet2d": (lambda: build_unet((64, 64, 1), depth=3, base_filters=16), (8, 64, 64, 1), {}),
    "unet3d": (lambda: build_unet((32, 32, 32, 1), depth=3, base_filters=8), (4, 32, 32, 32, 1), {}),
    # its peak is Adam's update (three weight-sized temporaries), which no activation offload lowers
    "dense_chain_forced": (lambda: dense_chain(512, 4), (512, 512), dict(min_bytes=0, keep_last=0)),
}


@pytest.fixture(scope="module")
def rows():
    # module-scoped, so set up before the function-scoped fixture that turns host copies on: do it here
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lms_torch, "CPU_HOST_COPIES", True)
        return {name: measure(name, build, shape, settings) for name, (build, shape, settings) in CASES.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_report_predicts_the_torch_step_peak_within_15_percent(rows, case):
    row = rows[case]
    for kind in ("plain", "wrapped"):
        measured, predicted = row[f"{kind}_nogc"], row[f"report_{kind}"]
        assert abs(predicted / measured - 1) <= TOLERANCE, (
            f"{case} {kind}: report {predicted / 2**20:.1f} MiB vs measured {measured / 2**20:.1f} MiB")


@pytest.mark.parametrize("case", ["unet2d", "unet3d"])
def test_wrapped_peak_is_below_plain_by_what_the_report_predicts(rows, case):
    row = rows[case]
    measured_ratio = row["wrapped_nogc"] / row["plain_nogc"]
    predicted_ratio = row["report_wrapped"] / row["report_plain"]
    assert measured_ratio < 1
    assert measured_ratio <= predicted_ratio * (1 + TOLERANCE), (measured_ratio, predicted_ratio)


def test_negative_control_the_tensorflow_model_of_a_plain_step_misses_torch(rows, monkeypatch):
    """Without the torch terms (outputs held until the forward returns, autograd's saved copies, the recompute,
    Adam's foreach temporaries) the plain prediction is far outside the tolerance."""
    simulate = planner.simulate
    monkeypatch.setattr(planner, "simulate", lambda *args, **kw: simulate(*args, **{**kw, "backend": "tensorflow"}))
    monkeypatch.setattr(planner, "update_temporary_bytes", lambda *args, **kwargs: 0)
    build, shape, _ = CASES["unet2d"]
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(optimizer="adam", loss="binary_crossentropy")
    predicted = predicted_step_bytes(keras_lms.report(model, batch_size=shape[0]).plain, model)
    measured = rows["unet2d"]["plain_nogc"]
    assert abs(predicted / measured - 1) > 2 * TOLERANCE, (predicted, measured)


def test_budget_counts_the_optimizer_update_on_torch():
    """A budget that holds weights, gradients, Adam's slots and the activations but not Adam's foreach
    temporaries (three weight-sized tensors on torch) cannot be met; with SGD (none) the same budget fits."""
    model = dense_chain(512, 4)
    model.compile(optimizer="adam", loss="mse")
    static = planner.static_bytes(model, None)
    update = planner.update_temporary_bytes(model, keras.optimizers.Adam())
    assert update == 3 * planner.variable_bytes(model.trainable_variables)
    budget = static + update // 2
    with pytest.raises(keras_lms.BudgetError, match="optimizer-update temporaries"):
        keras_lms.report(model, batch_size=16, device_budget=budget)
    model.compile(optimizer="sgd", loss="mse")
    assert planner.update_temporary_bytes(model, model.optimizer) == 0
    rep = keras_lms.report(model, batch_size=16, device_budget=budget)
    assert rep.wrapped.budget_bytes <= budget
