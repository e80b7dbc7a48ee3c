"""torch back end: wrapped vs plain on the same weights and seeds — loss, every gradient, BatchNorm statistics,
Dropout masks (tests/test_numerics.py for torch)."""

import keras
import numpy as np
import pytest
import torch

import keras_lms
from keras_lms.offload import torch as lms_torch
from tests import models
from tests.torch.torch_oracle import assert_matches, compare_step, restore, rng_state, set_rng_state, snapshot

RNG = np.random.default_rng(0)


CASES = models.ORACLE_CASES
images = models.images


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("settings", [dict(min_bytes=0, keep_last=0, prefetch=0), dict(min_bytes=0, prefetch=2),
                                      dict()], ids=["all-prefetch0", "keep1-prefetch2", "defaults"])
def test_wrapped_step_matches_plain(name, settings):
    build, data = CASES[name]
    model = build()
    wrapped = keras_lms.wrap(model, **settings)
    assert_matches(model, wrapped, data())
    if settings.get("min_bytes") == 0:
        assert any(e.offloaded for e in wrapped.lms_plan)


@pytest.mark.parametrize("name", ["cnn_bn_dropout", "unet2d", "multi_io", "subclassed"])
def test_without_copies_matches_plain(name, no_host_copies):
    """The CPU default: the 'host copy' is the tensor itself; recompute and numerics are unchanged."""
    build, data = CASES[name]
    model = build()
    lms_torch.reset_transfer_stats()
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0), data())
    stats = lms_torch.transfer_stats()
    assert stats["offloaded_calls"] > 0 and stats["d2h_bytes"] == 0


def test_host_copies_are_made_and_brought_back():
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    lms_torch.reset_transfer_stats()
    assert_matches(model, wrapped, images(size=32, channels=1))
    stats = lms_torch.transfer_stats()
    assert stats["d2h_copies"] > 10 and stats["h2d_copies"] >= stats["d2h_copies"] - 2
    # relu layers take their gradient from their output's host copy, shared with the consumer's swap-in
    assert stats["output_gradient_calls"] == 0  # unet2d fuses its activations into the convolutions
    model = models.resnet_blocks()
    lms_torch.reset_transfer_stats()
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0), images())
    stats = lms_torch.transfer_stats()
    assert stats["output_gradient_calls"] == 4 and stats["shared_swap_ins"] >= 2


def test_state_updates_happen_once_per_step():
    """BatchNorm moving stats and seed states advance exactly as in the plain model (not twice)."""
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    result = compare_step(model, wrapped, images())
    changed = result["state_changed"]
    assert any("moving_mean" in p for p in changed) and any("seed_generator" in p for p in changed)
    assert max(result["state"].values()) == 0.0


@pytest.mark.parametrize("seed", [None, 7], ids=["torch-global-rng", "seed-generator"])
def test_dropout_masks_identical_in_forward_and_backward(seed):
    """The input gradient of Dense -> Dropout is the mask / (1 - rate): it must equal the plain model's.

    Keras' torch Dropout without a seed draws from torch's global RNG (restored for the recompute), with a
    seed from its SeedGenerator variable (restored from the snapshot)."""
    inp = keras.Input((64,))
    model = keras.Model(inp, keras.layers.Dropout(0.5, seed=seed)(keras.layers.Dense(64)(inp)))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x0 = torch.tensor(RNG.random((8, 64)).astype("float32"))
    start, rng = snapshot(model), rng_state()

    def input_grad(m):
        x = x0.clone().requires_grad_(True)
        out = m(x, training=True)
        out.sum().backward()
        return out.detach(), x.grad

    out_p, g_p = input_grad(model)
    restore(model, start)
    set_rng_state(rng)
    out_w, g_w = input_grad(wrapped)
    assert bool(((out_p == 0) == (out_w == 0)).all())
    assert 0.3 < float((out_p == 0).float().mean()) < 0.7
    torch.testing.assert_close(g_w, g_p, rtol=0, atol=0)


def test_batchnorm_statistics_of_the_recompute_match():
    """BatchNorm in training mode normalises with the batch statistics; the recompute must see the same batch
    (gamma/beta gradients depend on them), and the moving statistics are updated once."""
    inp = keras.Input((8, 8, 4))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    model = keras.Model(inp, keras.layers.Dense(3)(bn(inp * 3.0 + 1.0)))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    result = assert_matches(model, wrapped, images(size=8, channels=4))
    assert {bn.moving_mean.path, bn.moving_variance.path} <= set(result["state_changed"])
    assert result["grads"][bn.gamma.path] == 0.0


def test_shared_layer_gets_gradients_from_every_call():
    model = models.multi_io()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    data = {"image": images(), "meta": RNG.random((4, 5)).astype("float32")}
    assert_matches(model, wrapped, data)
    shared = [e for e in wrapped.lms_plan if e.layer == "shared_dense"]
    assert len(shared) == 2 and all(e.offloaded for e in shared)


def test_mixed_precision(mixed_precision):
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    assert_matches(model, wrapped, images(size=32, channels=1), tol=1e-3)
    dtypes = {d for e in wrapped.lms_plan if e.offloaded for d in e.dtypes}
    assert "float16" in dtypes  # activations go to host in their own dtype


def test_mixed_precision_host_copies_are_float16(mixed_precision, monkeypatch):
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    copied = []
    original = lms_torch.Transfer.to_host

    def spy(self, tensor):
        copied.append(tensor.dtype)
        return original(self, tensor)

    monkeypatch.setattr(lms_torch.Transfer, "to_host", spy)
    out = wrapped(torch.tensor(images()), training=True)
    out.float().sum().backward()
    # Layer.__call__ casts the float32 model input to the compute dtype before the first call sees it.
    assert len(copied) >= 8 and set(copied) == {torch.float16}
