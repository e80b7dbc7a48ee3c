"""Fused slab chains (keras_lms/offload/tensorflow/slab_chains.py): a BatchNorm -> ReLU -> convolution chain whose
convolution recomputes its input from the BatchNorm input's host copy, against the same step unfused and the
plain model, on the same weights and seeds. The bytes it saves are measured in the executed graph by
tests/offload/tensorflow/test_link_traffic.py."""

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload.tensorflow import slab_calls, slab_chains
from tests import models
from tests.models import images
from tests.offload.tensorflow.test_slabs import SLAB, SLAB_TOL, bn_unet2d, unet3d
from tests.oracle import compare_step, restore, snapshot, targets_for, train_step

pytestmark = pytest.mark.tensorflow(reason="slabs are the TensorFlow back end's mechanism")

CASES = {
    "unet2d_conv_bn_relu": (bn_unet2d, lambda: images(size=32, channels=1, rng=np.random.default_rng(0))),
    "unet3d_bn_dropout": (unet3d, lambda: models.near_ties((2, 16, 16, 16, 1), rng=np.random.default_rng(0))),
}


@pytest.fixture
def chain_spy(monkeypatch):
    """Counts the windows a fused chain recomputes (the mechanism ran, not the unfused fallback)."""
    seen = {"windows": 0}
    original = slab_calls.SlabCalls._chain_window

    def spy(self, *args, **kwargs):
        seen["windows"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(slab_calls.SlabCalls, "_chain_window", spy)
    return seen


@pytest.fixture(autouse=True)
def short_chains(monkeypatch):
    """Both kinds of chain (the shorter one is off by default: it raises the max-cube peaks)."""
    monkeypatch.setattr(slab_chains, "SHORT_CHAINS", True)


def one_step(model, start, x, y, fused: bool, monkeypatch):
    monkeypatch.setattr(slab_chains, "ENABLED", fused)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    plan = wrapped.plan(batch_size=len(x))
    restore(model, start)
    keras.utils.set_random_seed(1)  # the same Dropout masks in both runs
    loss, grads, _ = train_step(wrapped, x, y, True)
    state = snapshot(model)
    restore(model, start)
    return plan, float(np.asarray(loss)), [np.asarray(g) for g in grads], state


@pytest.mark.parametrize("name", CASES)
def test_fused_chains_match_the_unfused_step_and_the_plain_model(name, chain_spy, monkeypatch):
    build, data = CASES[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = data()
    y = targets_for(model, x)
    start = snapshot(model)
    plan, loss_f, grads_f, state_f = one_step(model, start, x, y, True, monkeypatch)
    fused = [e for e in plan if e.recompute_from is not None]
    assert len(fused) >= 2 and all(e.decision == "recompute" for e in fused), plan
    for e in fused:  # BatchNorm -> ReLU -> this convolution, or BatchNorm -> this ReLU (output read elsewhere)
        source, between = e.recompute_from
        assert plan[source].layer_class == "BatchNormalization" and "fused chain" in e.reason
        if between is None:
            assert e.layer_class == "ReLU"
        else:
            assert plan[between].layer_class == "ReLU" and e.new_host_bytes == 0
    if name == "unet2d_conv_bn_relu":  # both kinds: the block's second ReLU is the skip, read by two layers
        assert {e.recompute_from[1] is None for e in fused} == {True, False}
    assert chain_spy["windows"] >= 2 * len(fused)  # ran: every fused convolution cut its windows from BatchNorm's
    windows = chain_spy["windows"]
    plan_u, loss_u, grads_u, state_u = one_step(model, start, x, y, False, monkeypatch)
    assert not any(e.recompute_from for e in plan_u) and chain_spy["windows"] == windows  # control: unfused
    # the same loss and state (moving statistics, seeds); gradients equal up to float32 rounding (measured
    # <= 1.2e-8 absolute): the recomputed windows are the forward's element-wise values, the first-pass sums
    # are taken over the same slabs in the same order
    assert loss_f == loss_u
    for a, b in zip(state_f, state_u):
        np.testing.assert_array_equal(a, b)
    for gf, gu in zip(grads_f, grads_u):
        np.testing.assert_allclose(gf, gu, rtol=1e-5, atol=1e-7)
    # and both match the plain model as slabs do (tests/offload/tensorflow/test_slabs.py)
    monkeypatch.setattr(slab_chains, "ENABLED", True)
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB), x, y)
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert result["loss"] <= 1e-6


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_fused_chains_are_exact_in_float64(dtype_policy, chain_spy):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB),
                          np.random.default_rng(3).random((4, 32, 32, 1)))
    assert chain_spy["windows"] > 0
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result


def test_no_chain_when_the_activation_has_another_consumer():
    # relu's output is read by the convolution and by the Add: the convolution cannot own its gradient
    inp = keras.Input((32, 32, 4))
    c = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
    r = keras.layers.ReLU()(keras.layers.BatchNormalization()(c))
    out = keras.layers.Add()([keras.layers.Conv2D(4, 3, padding="same")(r), r])
    model = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(out))
    plan = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB).plan(batch_size=4)
    assert any("slabs" in e.reason for e in plan)
    # no convolution recomputes its input; the ReLU recomputes its own output (the shorter chain)
    assert [(e.layer_class, e.recompute_from[1]) for e in plan if e.recompute_from] == [("ReLU", None)]


def test_the_shorter_chain_is_off_by_default(monkeypatch):
    monkeypatch.setattr(slab_chains, "SHORT_CHAINS", False)
    keras.utils.set_random_seed(0)
    plan = keras_lms.wrap(bn_unet2d(), min_bytes=0, keep_last=0, slab_bytes=SLAB).plan(batch_size=4)
    kinds = [e.recompute_from[1] is None for e in plan if e.recompute_from]
    assert kinds and not any(kinds)
