"""Tensors recomputed instead of copied (keras_lms/planning/recompute.py, offload/tensorflow/recomputed_copies.py):
with a device profile on which the host link is slower than the device's compute, the planner recomputes
windows of a 3D U-Net's level-0 tensors from host copies further up. The wrapped step must match the plain
model as slabs do, in float32 and exactly (up to rounding) in float64, and the recompute must have run. The
bytes it saves are measured in the executed graph by tests/offload/tensorflow/test_link_traffic.py."""

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload.tensorflow import recomputed_copies
from tests import models
from tests.models import images
from tests.offload.tensorflow.test_slabs import SLAB, SLAB_TOL, bn_unet2d, unet3d
from tests.oracle import compare_step

pytestmark = pytest.mark.tensorflow(reason="slabs are the TensorFlow back end's mechanism")

CASES = {
    "unet2d_conv_bn_relu": (bn_unet2d, lambda: images(size=32, channels=1, rng=np.random.default_rng(0))),
    "unet3d_bn_dropout": (unet3d, lambda: models.near_ties((2, 16, 16, 16, 1), rng=np.random.default_rng(0))),
}


def counting_spy(monkeypatch, owner, name: str) -> dict:
    """Replace ``owner.name`` by a wrapper that counts its calls in the returned dict's ``"windows"``."""
    seen = {"windows": 0}
    original = getattr(owner, name)

    def spy(self, *args, **kwargs):
        seen["windows"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


@pytest.fixture
def recompute_spy(monkeypatch):
    """Counts the windows recomputed from a producer's inputs (the mechanism ran, not a host copy)."""
    return counting_spy(monkeypatch, recomputed_copies.RecomputedWindows, "_recomputed_window")


@pytest.fixture
def upsampled_spy(monkeypatch):
    """Counts the windows of an up-sampler's output recomputed from its input."""
    return counting_spy(monkeypatch, recomputed_copies.RecomputedWindows, "_upsampled_window")


def wrap(model, profile="h100-pcie5"):
    return keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile=profile)


@pytest.mark.parametrize("name", CASES)
def test_recomputed_tensors_match_the_plain_model(name, recompute_spy):
    build, data = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = data()
    wrapped = wrap(model)
    plan = wrapped.plan(batch_size=len(x))
    producers = [e for e in plan if e.recomputed_output]
    readers = [e for e in plan if e.recomputed_inputs]
    assert producers and readers, plan
    assert all(e.decision == "recompute" and "recomputed in windows" in e.reason for e in readers)
    result = compare_step(model, wrapped, x)
    assert recompute_spy["windows"] >= len(producers)  # ran: windows were recomputed, not cut from host copies
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert result["loss"] <= 1e-6


def test_control_no_profile_recomputes_nothing(recompute_spy):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    assert not any(e.recomputed_output or e.recomputed_inputs for e in wrapped.plan(batch_size=4))
    compare_step(model, wrapped, images(size=32, channels=1, rng=np.random.default_rng(0)))
    assert recompute_spy["windows"] == 0


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_recomputed_tensors_are_exact_in_float64(dtype_policy, recompute_spy, upsampled_spy):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    result = compare_step(model, wrap(model), np.random.default_rng(3).random((4, 32, 32, 1)))
    assert recompute_spy["windows"] > 0 and upsampled_spy["windows"] > 0  # (the transposed convolution's too)
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result


def test_a_widening_first_convolution_is_recomputed_from_the_small_input(recompute_spy, monkeypatch):
    """``slab_bytes`` between the one-channel input (16 KiB) and the first convolution's 4-channel output
    (64 KiB): the convolution is cut by its output, and its output is recomputed from the input's host copy
    instead of being copied. The wrapped step still matches the plain one. Control: cut by its input alone (as
    before), the convolution runs whole and its output cannot be recomputed."""
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    x = images(size=32, channels=1, rng=np.random.default_rng(0))
    first = model.layers[1].name
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="32KiB", device_profile="h100-pcie5")
    entry = {e.layer: e for e in wrapped.plan(batch_size=len(x))}[first]
    assert entry.recomputed_output and "slabs" in entry.reason, entry
    result = compare_step(model, wrapped, x)
    assert recompute_spy["windows"] > 0
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result

    from keras_lms.offload.tensorflow import slab_plan

    original = slab_plan.plan_slabs
    monkeypatch.setattr(slab_plan, "plan_slabs", lambda *args, output_bytes=0: original(*args[:4]))
    monkeypatch.setattr(recomputed_copies.slabs, "plan_slabs", slab_plan.plan_slabs)
    from keras_lms.offload.tensorflow import step_memory

    monkeypatch.setattr(step_memory, "plan_slabs", slab_plan.plan_slabs)
    control = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="32KiB", device_profile="h100-pcie5")
    entry = {e.layer: e for e in control.plan(batch_size=len(x))}[first]
    assert not entry.recomputed_output and "slabs" not in entry.reason, entry


@pytest.mark.parametrize("nearest", [False, True], ids=["conv2d_transpose", "upsampling2d"])
def test_an_upsampled_tensor_is_recomputed_from_its_input(nearest, upsampled_spy, monkeypatch):
    """The up-sampler's output (4x its input's bytes) is not copied: the readers' windows run the layer on its
    input's rows (``layer_facts.upsampling_scale``), and the step still matches the plain model. Control:
    without the up-sampling rule the planner cannot recompute it and the mechanism never runs."""
    keras.utils.set_random_seed(0)
    model = bn_unet2d(nearest=nearest)
    x = images(size=32, channels=1, rng=np.random.default_rng(0))
    upsampler = next(layer.name for layer in model.layers if "Transpose" in type(layer).__name__
                     or "UpSampling" in type(layer).__name__)
    entry = {e.layer: e for e in wrap(model).plan(batch_size=len(x))}[upsampler]
    assert entry.recomputed_output, entry
    result = compare_step(model, wrap(model), x)
    assert upsampled_spy["windows"] > 0
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert result["loss"] <= 1e-6

    from keras_lms.planning import layer_facts

    monkeypatch.setattr(layer_facts, "upsampling_scale", lambda unit, rank: None)
    upsampled_spy["windows"] = 0
    entry = {e.layer: e for e in wrap(model).plan(batch_size=len(x))}[upsampler]
    assert not entry.recomputed_output, entry
    compare_step(model, wrap(model), x)
    assert upsampled_spy["windows"] == 0


def test_an_upsampled_tensor_is_recomputed_from_an_input_kept_on_the_device(upsampled_spy):
    """``min_bytes`` keeps the transposed convolution's small input on the device (no host copy at all): its
    output's windows are the layer run on rows sliced there, and the step still matches the plain model."""
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    x = images(size=32, channels=1, rng=np.random.default_rng(0))

    def wrap_keeping_small():
        return keras_lms.wrap(model, min_bytes="48KiB", keep_last=0, slab_bytes=SLAB, device_profile="h100-pcie5")

    entry = next(e for e in wrap_keeping_small().plan(batch_size=len(x)) if "Transpose" in e.layer_class)
    assert entry.tensor_offloaded == [False] and entry.recomputed_output, entry
    result = compare_step(model, wrap_keeping_small(), x)
    assert upsampled_spy["windows"] > 0
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert result["loss"] <= 1e-6
