"""Folded poolings where no level sweep runs (keras_lms/offload/tensorflow/pooling_folds.py, pooling_fold_calls.py):
a U-Net skip's max pooling hands its output gradient to its activation's slab backward, which adds the pooling's
input gradient window by window. Exact against the plain model on the same weights and seeds, with the control
``ENABLED = False``; in the graph grappler optimises, the pooling's backward brings nothing back and no whole sum
of the skip's gradient parts runs; the planner's models (memory, traffic) say the same."""

import collections

import keras
import numpy as np
import pytest

import keras_lms
from keras_lms.offload.tensorflow import pooling_fold_calls, pooling_folds, sweeps
from tests.offload.tensorflow.test_slabs import SLAB, SLAB_TOL, bn_unet2d
from tests.oracle import compare_step

pytestmark = pytest.mark.tensorflow(reason="folds are the TensorFlow back end's slab mechanism")

X = np.random.default_rng(3).random((4, 32, 32, 1))


@pytest.fixture(params=[True, False], ids=["folded", "control"])
def fold(request, monkeypatch):
    """Folds on (the default) or off (the control), and a count of what ran: pooling gradients handed to an
    activation and pooling windows differentiated there."""
    monkeypatch.setattr(pooling_folds, "ENABLED", request.param)
    seen = collections.Counter()
    calls = pooling_fold_calls.PoolingFoldCalls
    hand, rows = calls._hand_pooling_gradient, calls._pooling_rows

    def spy_hand(self, *args):
        result = hand(self, *args)
        seen["handed"] += result is not None
        return result

    monkeypatch.setattr(pooling_fold_calls.PoolingFoldCalls, "_hand_pooling_gradient", spy_hand)
    monkeypatch.setattr(pooling_fold_calls.PoolingFoldCalls, "_pooling_rows",
                        lambda self, *args: seen.update(["windows"]) or rows(self, *args))
    return request.param, seen


def _wrapped(model):
    return keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_the_skip_poolings_gradient_is_taken_in_its_activations_backward(dtype_policy, fold):
    """Without a device profile nothing is swept: the encoder's skip activation takes its pooling's gradient in
    its own slab backward, in the pooling's windows; the step stays exact (float64, 1e-12)."""
    enabled, seen = fold
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    wrapped = _wrapped(model)
    plan = wrapped.plan(batch_size=4)
    assert not any(e.sweep for e in plan)
    folded = {e.index: e.folded_pooling for e in plan if e.folded_pooling}
    result = compare_step(model, wrapped, X)
    if enabled:
        assert len(folded) == 1, folded
        (act, (pool, stride)), = folded.items()
        assert plan[act].layer_class == "ReLU" and plan[pool].layer_class == "MaxPooling2D" and stride == 2
        assert f"taken in {plan[act].layer}'s slab backward" in plan[pool].reason
        assert seen["handed"] == 1 and seen["windows"] >= 2, seen
    else:
        assert not folded and not seen, (folded, seen)
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result


def test_float32_within_the_slab_tolerance(fold):
    keras.utils.set_random_seed(0)
    model = bn_unet2d()
    result = compare_step(model, _wrapped(model), X)
    assert max(result["grads"].values()) <= SLAB_TOL and max(result["state"].values()) <= SLAB_TOL, result
    assert fold[1]["handed"] == (1 if fold[0] else 0)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_fold_computes_the_unfolded_steps_values_bit_for_bit(policy, monkeypatch):
    """The fold adds the same window-wise pooling gradient to the same skip part (``a + b == b + a``): folded and
    unfolded wrapped steps give identical gradients, in float32 and under mixed precision (float16 activations,
    float16 gradients), on the same weights and seeds; and both within the slab tolerance of the plain step."""
    from tests.oracle import restore, snapshot, targets_for, train_step

    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = bn_unet2d()
        y = targets_for(model, X)
        start, steps = snapshot(model), {}
        for enabled in (True, False):
            monkeypatch.setattr(pooling_folds, "ENABLED", enabled)
            restore(model, start)
            keras.utils.set_random_seed(1)
            wrapped = _wrapped(model)
            assert any(e.folded_pooling for e in wrapped.plan(batch_size=4)) == enabled
            steps[enabled] = train_step(wrapped, X, y)
    finally:
        keras.config.set_dtype_policy("float32")
    (loss_f, grads_f, _), (loss_u, grads_u, _) = steps[True], steps[False]
    assert loss_f == loss_u
    assert all(np.array_equal(a, b) for a, b in zip(grads_f, grads_u))


def test_a_swept_level_folds_in_its_sweep_not_in_its_activation(monkeypatch):
    """Where the level is swept, the sweep's first pass takes the pooling (``Sweep.folded``); the activation's
    entry names the fold too, and the step binds only the sweep's."""
    monkeypatch.setattr(sweeps, "FORCED", True)
    model = bn_unet2d()
    wrapped = _wrapped(model)
    plan = wrapped.plan(batch_size=4)
    swept = [e for e in plan if e.sweep_folded]
    assert swept, "the forced sweep folds the pooling"
    pool = swept[0].sweep_folded[0]
    assert "level sweep" in plan[pool].reason and "slab backward" not in plan[pool].reason
    seen = collections.Counter()
    hand = pooling_fold_calls.PoolingFoldCalls._hand_pooling_gradient
    monkeypatch.setattr(pooling_fold_calls.PoolingFoldCalls, "_hand_pooling_gradient",
                        lambda self, *args: seen.update(["handed"]) or hand(self, *args))
    result = compare_step(model, wrapped, X)
    assert not seen and max(result["grads"].values()) <= SLAB_TOL, (seen, result)


def test_the_planners_models_drop_the_poolings_copy_back_and_its_sum(monkeypatch):
    """The traffic model: the pooling's backward brings nothing back (the activation's windows serve both), one
    skip-sized tensor less per step; the memory model: no whole sum of the skip's parts."""
    from keras_lms.planning import memory_model

    model = bn_unet2d(size=64)
    summed = []
    hold = memory_model._hold_waiting_gradients
    monkeypatch.setattr(memory_model, "_hold_waiting_gradients",
                        lambda *args: summed.append(args[-1]) or hold(*args))
    reports = {}
    for enabled in (True, False):
        monkeypatch.setattr(pooling_folds, "ENABLED", enabled)
        reports[enabled] = keras_lms.report(_wrapped(model), batch_size=4)
    rows = {enabled: {r["layer"]: r for r in rep.rows} for enabled, rep in reports.items()}
    pool = next(name for name, r in rows[True].items() if r["class"] == "MaxPooling2D")
    skip = rows[True][pool]["input_bytes"]
    assert rows[True][pool]["host_to_device_bytes"] == 0 < rows[False][pool]["host_to_device_bytes"]
    saved = (reports[False].totals["host_to_device_bytes_per_step"]
             - reports[True].totals["host_to_device_bytes_per_step"])
    assert saved == pytest.approx(skip, rel=0.01), (saved, skip)
    assert reports[True].wrapped.peak_bytes <= reports[False].wrapped.peak_bytes
    assert any(summed), "the folded pooling's keys are summed window by window"


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
@pytest.mark.parametrize("align", [True, False], ids=["aligned", "control"])
def test_a_folding_activation_keeps_its_short_chain(dtype_policy, align, monkeypatch):
    """The skip ReLU cut into its pooling's windows takes its BatchNorm with it (``pooling_folds.alignments``,
    ``PlanEntry.slab_align``), so the two still form a short chain (``slab_chains``: the ReLU's backward
    recomputes its output from the BatchNorm input's copy and takes BatchNorm's first pass). At 44 rows in 8
    slabs the slab size puts windows on odd rows: aligned, the ReLU takes the pooling's gradient and runs the
    short chain in the same windows, exact (float64, 1e-12); the control (the ReLU alone aligned) folds but
    forms no chain there."""
    from keras_lms.offload.tensorflow import slab_chains
    from keras_lms.offload.tensorflow.step import StepContext

    monkeypatch.setattr(slab_chains, "SHORT_CHAINS", True)
    monkeypatch.setattr(pooling_folds, "ALIGN_NORMALIZATION", align)
    chained, handed = [], []
    chain, hand = StepContext._chain, pooling_fold_calls.PoolingFoldCalls._hand_pooling_gradient
    monkeypatch.setattr(StepContext, "_chain", lambda self, *args: chained.append(chain(self, *args)) or chained[-1])
    monkeypatch.setattr(pooling_fold_calls.PoolingFoldCalls, "_hand_pooling_gradient",
                        lambda self, *args: handed.append(hand(self, *args)) or handed[-1])
    keras.utils.set_random_seed(0)
    model = bn_unet2d(size=44)
    wrapped = _wrapped(model)
    plan = wrapped.plan(batch_size=4)
    (act,) = [e.index for e in plan if e.folded_pooling]
    bn = act - 1
    assert plan[bn].layer_class == "BatchNormalization" and plan[act].slab_align == 2
    assert plan[bn].slab_align == (2 if align else 1)
    short = {e.index for e in plan if e.recompute_from is not None and e.recompute_from[1] is None}
    assert (act in short) == align, short
    result = compare_step(model, wrapped, np.random.default_rng(3).random((4, 44, 44, 1)))
    ran = {c[0].index for c in chained if c is not None and c[1] is None}  # the chain's BatchNorm records
    assert (bn in ran) == align and any(h is not None for h in handed), (ran, handed)
    assert max(result["grads"].values()) <= 1e-12 and max(result["state"].values()) <= 1e-12, result
    assert result["loss"] <= 1e-14 and result["outputs"] <= 1e-12, result


def test_no_fold_for_an_activation_differentiated_from_its_input():
    """GELU's gradient needs its input, not its output: its slab backward has no window path to add the
    pooling's share to, so the planner folds nothing there and the pooling differentiates itself (exact)."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 1))
    skip = layers.Activation("gelu")(layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same")(inp)))
    x = layers.ReLU()(layers.Conv2D(8, 3, padding="same")(layers.MaxPooling2D()(skip)))
    x = layers.Conv2DTranspose(4, 2, strides=2, padding="same")(x)
    x = layers.ReLU()(layers.Conv2D(4, 3, padding="same")(layers.Concatenate()([x, skip])))
    model = keras.Model(inp, layers.Conv2D(1, 1)(x))
    wrapped = _wrapped(model)
    plan = wrapped.plan(batch_size=4)
    assert any("slabs" in e.reason for e in plan) and not any(e.folded_pooling for e in plan)
    result = compare_step(model, wrapped, X)
    assert max(result["grads"].values()) <= SLAB_TOL, result
