"""Slabs, fused chains, recomputed tensors and level sweeps forced on across real architectures (keras.applications,
weights=None, small inputs), against the plain model: the oracle of tests/test_applications.py with every
full-resolution call cut into 8 KiB slabs and the time-aware plan on a PCIe profile (so that tensors are
recomputed in windows instead of copied), with every Conv -> BatchNorm -> ReLU run swept (sweeps.FORCED: at these
sizes the planner would sweep none).

Float64, because slabs change the order of sums (batch statistics, weight gradients), and two of these models are
ill-conditioned at these input sizes: a relative input change of 1e-15 moves ResNet50's float64 output by 8e-8
(EfficientNetB0's by 0.19; MobileNetV2's by 5e-12, VGG16's by 4e-17), through BatchNormalization over 1x1 maps
of a batch of 2. So each model's tolerance is its own measured sensitivity to a change of rounding (the plain
model on a 1e-15-perturbed input), times a safety factor, never looser than float64 rounding needs: a wrong
gradient would be off by far more. The models are the fastest ones covering depthwise and separable convolutions,
residual Adds and plain stacks (MobileNetV2, VGG16, ResNet50: ~2 min).
"""

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload.tensorflow import sweeps
from tests import models
from tests.oracle import compare_step

pytestmark = [pytest.mark.tensorflow(reason="slabs are the TensorFlow back end's mechanism"), pytest.mark.slow]

SLAB = "8KiB"
MODELS = ("MobileNetV2", "VGG16", "ResNet50")
SAFETY = 1000.0


def _sensitivity(model, x) -> float:
    """Relative change of the plain model's output when its input moves by 1e-15 relative (its conditioning)."""
    y0 = np.asarray(model(x, training=True))
    noise = 1 + 1e-15 * np.random.default_rng(1).standard_normal(x.shape)
    y1 = np.asarray(model(x * noise, training=True))
    return float(np.linalg.norm(y1 - y0) / np.linalg.norm(y0))


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
@pytest.mark.parametrize("name", MODELS)
def test_zoo_with_slabs_and_recompute_matches_plain(name, dtype_policy, monkeypatch):
    monkeypatch.setattr(sweeps, "FORCED", True)
    build, size, _, _ = models.APPLICATIONS[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = np.random.default_rng(0).random((2, size, size, 3))
    start = [np.array(v.numpy(), copy=True) for v in model.variables]
    sensitivity = _sensitivity(model, x)
    for v, value in zip(model.variables, start):  # the probe's training-mode calls moved BatchNorm statistics
        v.assign(value)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=1, slab_bytes=SLAB, device_profile="h100-pcie5")
    plan = wrapped.plan(batch_size=len(x))
    slabbed = sum("slabs" in e.reason for e in plan)
    recomputed = sum(e.recomputed_output for e in plan) + sum(e.decision == "recompute" for e in plan)
    assert slabbed >= 15 and recomputed >= 4, (slabbed, recomputed)  # the mechanisms under test are on
    swept = sum(e.sweep is not None for e in plan)
    if name == "ResNet50":  # each bottleneck block's 3x3 Conv -> BatchNorm -> ReLU (its 1x1 convolutions are
        assert swept >= 30, plan  # "valid", not exact-row slabs); MobileNetV2's ReLU6 and VGG16 have no unit
    tol = max(1e-10, SAFETY * sensitivity)
    result = compare_step(model, wrapped, x)
    print(f"{name}: {slabbed} slab calls, {recomputed} recompute decisions, {swept} swept calls, "
          f"sensitivity {sensitivity:.1e}, "
          f"loss {result['loss']:.1e}, grads {max(result['grads'].values()):.1e}")
    assert result["loss"] <= tol, (result["loss"], tol)
    worst = sorted(result["grads"].items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= max(tol, 1e-8), worst
    # BatchNorm's moving variances (VGG16 has none). Its moving means are left to the loss and gradients: after
    # a normalisation they are ~0 (MobileNetV2's expand layers: ~1e-10), so their relative error is
    # cancellation (7.7e-6 measured against a sensitivity of 5e-12), while the batch means they come from
    # enter every normalised output the loss and gradients compare.
    variances = [v for k, v in result["state"].items() if "moving_variance" in k]
    assert (name == "VGG16") != bool(variances)
    assert max(variances, default=0.0) <= max(tol, 1e-8), result["state"]
