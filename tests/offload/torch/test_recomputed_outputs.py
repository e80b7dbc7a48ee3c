"""Recomputed instead of copied on torch (issue 26): with a device profile, the output of a BatchNormalization
(or of the activation after one) is never copied; its reader's backward brings the BatchNorm's input back and
recomputes it (keras_lms/offload/torch/recompute.py, planned by recompute_candidates.py).

What is checked, on a 3D U-Net with BatchNorm -> ReLU after every convolution, in the step that runs:

- the recompute runs (the offloader's ``recomputed_outputs`` counter, once per planned tensor) and the bytes
  the offloader copies each way equal the plan's traffic (``StepPlan.link_traffic``) exactly, and are lower than
  the plan without a profile by the recomputed tensors;
- the loss, every gradient and the BatchNorm moving statistics are bit-identical to the same wrapped model
  without recompute (float32 and mixed_float16), and match the plain model within the zoo's tolerance;
- a control: a recompute that leaves out the activation changes the gradients (the test sees the values the
  recompute produces);
- the planner's candidates: the activation after a lean BatchNorm, read by one copying call; not a tensor two
  calls copy, not float64 (Keras computes that BatchNorm in float32 on torch: no exact recompute).
"""

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload import active_backend
from keras_lms.offload import torch as lms_torch
from keras_lms.offload.torch import recompute
from keras_lms.planning.device_profile import load_profile
from tests import models
from tests.oracle import assert_matches, restore, snapshot, targets_for, train_step

pytestmark = pytest.mark.torch

PROFILE = "h100-pcie5"  # copies cost far more than element-wise recompute: every candidate is recomputed


def _unet():
    return models.bn_relu_unet3d()


def _images(batch=2):
    return np.random.default_rng(3).random((batch, 16, 16, 16, 1)).astype("float32")


def _step_plan(wrapped, batch):
    backend = active_backend()
    return wrapped._plan_step(backend.example_inputs(wrapped.inner_model, batch), {}, batch)


def _run(model, wrapped, x, y):
    """One training step of ``wrapped``: (loss, gradients, state after), the model's weights restored."""
    start = snapshot(model)
    lms_torch.reset_transfer_stats()
    loss, grads, _ = train_step(wrapped, x, y)
    stats = lms_torch.transfer_stats()
    after = snapshot(model)
    restore(model, start)
    return loss, grads, after, stats


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_recomputed_outputs_are_bit_identical_and_never_copied(policy):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = _unet()
        x = _images()
        y = targets_for(model, x)
        copied = keras_lms.wrap(model, min_bytes=0)
        timed = keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE)
        plan = _step_plan(timed, 2)
        recomputed = plan.recomputed
        names = sorted(plan.entries[p].layer_class for p in recomputed)
        assert len(recomputed) >= 4 and set(names) == {"ReLU"}, names
        results = {name: _run(model, m, x, y) for name, m in (("copied", copied), ("recomputed", timed))}
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    (loss_c, grads_c, state_c, stats_c), (loss_r, grads_r, state_r, stats_r) = results["copied"], results["recomputed"]
    assert stats_c["recomputed_outputs"] == 0
    assert stats_r["recomputed_outputs"] == len(recomputed)
    # the bytes that cross, counted by the offloader, are the plan's to the byte
    traffic = plan.link_traffic()
    assert stats_r["d2h_bytes"] == traffic.device_to_host_bytes
    assert stats_r["h2d_bytes"] == traffic.host_to_device_bytes
    saved = sum(plan.entries[p].output_bytes for p in recomputed)
    assert stats_c["d2h_bytes"] - stats_r["d2h_bytes"] == saved
    assert stats_c["h2d_bytes"] - stats_r["h2d_bytes"] == saved
    assert float(loss_c) == float(loss_r)
    for a, b in zip(grads_c, grads_r):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(state_c, state_r):  # BatchNorm moving statistics, updated once, by the forward
        np.testing.assert_array_equal(a, b)


def test_recomputed_outputs_match_the_plain_model():
    model = _unet()
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), _images())


def test_a_wrong_recompute_changes_the_gradients(monkeypatch):
    """The control: without the activation in the recompute, the convolutions after it see other inputs."""
    model = _unet()
    x = _images()
    y = targets_for(model, x)
    right = _run(model, keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), x, y)
    original = recompute._layers
    monkeypatch.setattr(recompute, "_layers", lambda norm, activation, c: original(norm, None, c))
    wrong = _run(model, keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), x, y)
    assert wrong[3]["recomputed_outputs"] == right[3]["recomputed_outputs"] > 0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(right[1], wrong[1]) if a is not None)


def test_candidates_are_activations_after_a_batchnorm_with_one_copying_reader():
    layers = keras.layers
    inp = keras.Input((8, 8, 4))
    r = layers.ReLU(name="relu")(layers.BatchNormalization(name="bn")(layers.Conv2D(4, 3, padding="same")(inp)))
    a = layers.Conv2D(4, 3, padding="same", name="reader_a")(r)
    shared = layers.ReLU(name="relu_shared")(layers.BatchNormalization(name="bn_shared")(a))
    b = layers.Conv2D(4, 3, padding="same", name="reader_b")(shared)
    c = layers.Conv2D(4, 3, padding="same", name="reader_c")(shared)  # a second copying reader
    model = keras.Model(inp, layers.Conv2D(1, 1)(layers.Add()([b, c])))
    plan = _step_plan(keras_lms.wrap(model, min_bytes=0, keep_last=0, device_profile=PROFILE), 2)
    candidates = {plan.entries[p].layer for p in plan.recompute_candidates()}
    assert candidates == {"relu"}
    assert {plan.entries[p].layer for p in plan.recomputed} == {"relu"}
    reason = next(e.reason for e in plan.entries if e.layer == "relu")
    assert "recomputes it from the host copy of" in reason
    rows = {r["layer"]: r for r in keras_lms.report(
        keras_lms.wrap(model, min_bytes=0, keep_last=0, device_profile=PROFILE), batch_size=2,
        device_profile=PROFILE).rows}
    assert rows["relu"]["decision"] == "recompute" and rows["relu"]["device_to_host_bytes"] == 0
    assert rows["reader_a"]["decision"] == "recompute"  # its input is recomputed, not copied
    assert rows["relu_shared"]["decision"] == "copy"  # two copying readers: its output is copied


def test_no_candidates_without_a_profile_or_in_float64():
    model = _unet()
    assert not _step_plan(keras_lms.wrap(model, min_bytes=0), 2).recomputed
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        model64 = _unet()
        plan = _step_plan(keras_lms.wrap(model64, min_bytes=0, device_profile=PROFILE), 2)
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    assert not plan.recompute_candidates()


def test_recompute_slabs_cover_the_rows_once(monkeypatch):
    """The recompute runs slab by slab along axis 1 into one buffer: the same values as one slab."""
    model = _unet()
    x = _images()
    y = targets_for(model, x)
    whole = _run(model, keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), x, y)
    monkeypatch.setattr(recompute, "SLAB_ROWS", 100)  # 16 x 16 positions per row: one row per slab
    monkeypatch.setattr(recompute, "SLABS", 64)
    sliced = _run(model, keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), x, y)
    for a, b in zip(whole[1], sliced[1]):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_plan_predicts_the_recompute_in_the_step_time():
    model = _unet()
    plan = _step_plan(keras_lms.wrap(model, min_bytes=0, device_profile=PROFILE), 2)
    profile = load_profile(PROFILE)
    copied = plan.step_time(profile, recomputed=frozenset())
    timed = plan.step_time(profile)
    assert timed.host_to_device_bytes < copied.host_to_device_bytes
    assert timed.recompute_seconds > copied.recompute_seconds
    assert timed.step_seconds < copied.step_seconds


@pytest.mark.parametrize("name", sorted(models.ORACLE_CASES))
def test_the_oracle_zoo_matches_plain_with_recompute(name):
    """Every oracle model, every tensor offloaded and every candidate recomputed (a PCIe profile): plain's loss,
    outputs, gradients, BatchNorm statistics and Dropout masks within the zoo's tolerance."""
    build, data = models.ORACLE_CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, device_profile=PROFILE)
    lms_torch.reset_transfer_stats()
    assert_matches(model, wrapped, data())
    planned = sum(e.recomputed_output for e in wrapped.lms_plan)
    assert lms_torch.transfer_stats()["recomputed_outputs"] == planned
    if name in ("unet2d", "resnet_blocks"):  # BatchNorm -> ReLU layers (deep_supervision nests them in blocks)
        assert planned > 0


@pytest.mark.slow
def test_resnet50_matches_plain_with_recompute():
    """A real architecture (keras.applications, weights=None): BatchNormalization -> Activation("relu")
    throughout, so most of its activations are recomputed instead of copied."""
    build, size, _, tol = models.APPLICATIONS["ResNet50"]
    keras.utils.set_random_seed(0)
    model = build()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=1, device_profile=PROFILE)
    lms_torch.reset_transfer_stats()
    assert_matches(model, wrapped, np.random.default_rng(0).random((2, size, size, 3)).astype("float32"), tol=tol)
    planned = sum(e.recomputed_output for e in wrapped.lms_plan)
    assert planned >= 20 and lms_torch.transfer_stats()["recomputed_outputs"] == planned


def test_recompute_without_the_lean_normalization():
    """``lean_normalization=False`` (the BatchNorm's backward recomputes Keras' ops): the statistics are still
    captured for the recompute, and the step is bit-identical to the copying plan with the same setting."""
    model = _unet()
    x = _images()
    y = targets_for(model, x)
    copied = _run(model, keras_lms.wrap(model, min_bytes=0, lean_normalization=False), x, y)
    timed = _run(model, keras_lms.wrap(model, min_bytes=0, lean_normalization=False, device_profile=PROFILE), x, y)
    assert copied[3]["lean_normalization_calls"] == timed[3]["lean_normalization_calls"] == 0
    assert timed[3]["recomputed_outputs"] > 0 and timed[3]["d2h_bytes"] < copied[3]["d2h_bytes"]
    assert float(copied[0]) == float(timed[0])
    for a, b in zip(copied[1], timed[1]):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Unit:
    def __init__(self, axis):
        self.axis = axis


class _Norm:
    def __init__(self, axis=-1):
        self.unit = _Unit(axis)


def test_slab_bounds_cut_the_first_spatial_axis_into_contiguous_rows(monkeypatch):
    import torch

    monkeypatch.setattr(recompute, "SLAB_ROWS", 100)
    monkeypatch.setattr(recompute, "SLABS", 64)
    c = torch.zeros((2, 16, 16, 16, 4))
    bounds = recompute._slab_bounds(_Norm(), c)
    assert bounds[0][0] == 0 and bounds[-1][1] == 16 and len(bounds) == 16
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
    assert recompute._slab_bounds(_Norm(axis=1), c) == [(0, 16)]  # channels first: axis 1 would cut channels
    assert recompute._slab_bounds(_Norm(), torch.zeros((8, 4))) == [(0, 4)]  # no spatial axis: whole
    monkeypatch.setattr(recompute, "SLAB_ROWS", 1 << 14)
    assert recompute._slab_bounds(_Norm(), c) == [(0, 16)]  # 8192 positions: one slab


def test_a_resident_copy_waits_for_its_shared_reader():
    """``_HostCopy``: a recompute leaves the BatchNorm's input resident for the BatchNorm (``shared_pending``);
    the copy is dropped, and the buffer released, once that reader has taken it."""
    from keras_lms.offload.torch.transfer import _HostCopy

    host = _HostCopy(buffer=object(), pool=None, nbytes=8)
    host.pending = 2  # the recompute and the BatchNorm
    host.resident = swap = object()
    host.shared_pending = 1
    host.done(output_reader=False)  # the recompute's own read
    assert host.resident is swap and host.buffer is not None
    host.done(output_reader=False, shared=True)  # the BatchNorm took the resident copy
    assert host.resident is None and host.buffer is None and host.shared_pending == 0
