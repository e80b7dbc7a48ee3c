"""Slab-wise forward and backward (TensorFlow back end, keras_lms/offload/tensorflow/slabs.py): the wrapped model
against
the plain one on the same weights and seeds, with slabs small enough that every full-resolution layer is cut.

What runs is checked where it takes effect: a spy on ``tf_slabs.forward`` / ``tf_slabs.backward`` counts the
calls computed in slabs (zero with ``slab_bytes=0``, the control), and
tests/offload/tensorflow/test_executed_graph.py checks the
partition graphs TensorFlow executes (every transfer back slab-sized and gated).
"""

import collections

import keras
import numpy as np
import pytest

import keras_lms
from benchmarks.models import build_unet
from keras_lms.offload.tensorflow import slabs as tf_slabs
from keras_lms.planning import layer_facts
from tests import models
from tests.models import images
from tests.oracle import assert_matches, compare_step, restore, snapshot

pytestmark = pytest.mark.tensorflow(reason="slabs are the TensorFlow back end's mechanism (torch: lean_norm)")

SLAB = "16KiB"  # small enough that the test models' full-resolution layers are cut into about four slabs
# Weight gradients and batch statistics are sums over slabs: in float32 they differ from the plain model's by
# summation order. How much depends on the weights: a bias gradient is a sum of dy over every position, and when
# that sum nearly cancels its norm-relative error grows. Over seeds 0-7 of the fused-relu U-Net the worst was
# 4.6e-5 (a first-layer bias); with unseeded weights one CI run saw 1.8e-4. So the comparisons run on fixed
# seeds (SEED: weights, Dropout, data), and the float64 test is the proof that the gradient is right: the same
# comparisons shrink to <= 1e-12 there. With the default slab_bytes (256 MiB) none of the zoo's tensors is cut
# and the wrapped model stays bit-identical (tests/test_numerics.py, test_applications.py).
SLAB_TOL = 1e-4
SEED = 0


@pytest.fixture
def slab_spy(monkeypatch):
    """Counts, per layer class, the calls computed in slabs: forward, backward, BatchNorm statistics."""
    seen = collections.Counter()
    forward, backward, moments = tf_slabs.forward, tf_slabs.backward, tf_slabs.global_moments

    def spy_forward(run, window_of, n_inputs, plan):
        seen["forward"] += 1
        seen["forward_inputs_%d" % n_inputs] += 1
        return forward(run, window_of, n_inputs, plan)

    def spy_backward(plan, dy, window_of, differentiate, n_inputs, n_weights, *rest):
        seen["backward"] += 1
        seen["backward_inputs_%d" % n_inputs] += 1
        seen["halo" if plan.halo else "no_halo"] += 1
        seen["strided"] += plan.stride > 1
        return backward(plan, dy, window_of, differentiate, n_inputs, n_weights, *rest)

    def spy_moments(*args, **kwargs):
        seen["moments"] += 1
        return moments(*args, **kwargs)

    monkeypatch.setattr(tf_slabs, "forward", spy_forward)
    monkeypatch.setattr(tf_slabs, "backward", spy_backward)
    monkeypatch.setattr(tf_slabs, "global_moments", spy_moments)
    return seen


def unet3d():
    """3D U-Net with BatchNorm, Dropout, max pooling, transposed convolutions and concatenated skips."""
    return build_unet((16, 16, 16, 1), depth=2, base_filters=4, dropout=0.2)


def bn_unet2d(size=32, filters=4, nearest=False):
    """The simulated-peak benchmark's U-Net shape (Conv-BN-ReLU x2 per level, concatenated skips), 2D, small;
    up-sampled by a transposed convolution, or (``nearest``) by a 1x1 convolution and a nearest UpSampling2D."""
    layers = keras.layers

    def block(x, f):
        for _ in range(2):
            x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(f, 3, padding="same", use_bias=False)(x)))
        return x

    inp = keras.Input((size, size, 1))
    skip = block(inp, filters)
    x = block(layers.MaxPooling2D()(skip), 2 * filters)
    if nearest:
        x = layers.UpSampling2D(name="upsample")(layers.Conv2D(filters, 1)(x))
    else:
        x = layers.Conv2DTranspose(filters, 2, strides=2, padding="same")(x)
    x = block(layers.Concatenate()([x, skip]), filters)
    return keras.Model(inp, layers.Conv2D(1, 1, activation="sigmoid")(x))


def halo_stack():
    """Convolutions with halos of 1, 2 (kernel 5) and 4 (kernel 5, dilation 2), a 1x1 and an elu."""
    inp = keras.Input((24, 12, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    x = keras.layers.Conv2D(4, 5, padding="same")(x)
    x = keras.layers.ELU()(x)
    x = keras.layers.Conv2D(4, 5, padding="same", dilation_rate=2, activation="tanh")(x)
    x = keras.layers.Conv2D(2, 1)(x)
    return keras.Model(inp, keras.layers.GlobalAveragePooling2D()(x))


CASES = {  # name -> (build the model, its input from a numpy Generator)
    "unet3d_bn_dropout": (unet3d, lambda rng: models.near_ties((2, 16, 16, 16, 1), rng=rng)),
    "unet2d_conv_bn_relu": (bn_unet2d, lambda rng: images(size=32, channels=1, rng=rng)),
    "unet2d_fused_relu": (lambda: models.unet2d(size=32), lambda rng: images(size=32, channels=1, rng=rng)),
    "halo_stack": (halo_stack, lambda rng: rng.random((2, 24, 12, 3)).astype("float32")),
}


@pytest.mark.parametrize("name", CASES)
def test_slabs_match_the_plain_model(name, slab_spy):
    build, data = CASES[name]
    keras.utils.set_random_seed(SEED)  # weights and Dropout do not depend on the tests that ran before
    model = build()
    slab = {"unet3d_bn_dropout": "32KiB", "halo_stack": "4KiB"}.get(name, SLAB)
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=slab),
                   data(np.random.default_rng(SEED)), tol=SLAB_TOL)
    assert slab_spy["backward"] >= 4, slab_spy  # the mechanism ran (see the control below)
    if name == "unet3d_bn_dropout":
        # every kind ran: halos, BatchNorm statistics, tiling pooling, a convolution over a concatenation
        assert slab_spy["halo"] >= 4 and slab_spy["no_halo"] >= 2 and slab_spy["strided"] >= 1, slab_spy
        assert slab_spy["moments"] >= 1 and slab_spy["forward_inputs_2"] >= 1, slab_spy
        assert slab_spy["backward_inputs_2"] >= 1, slab_spy


def test_control_slab_bytes_zero_computes_whole(slab_spy):
    model = unet3d()
    result = assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=0),
                            models.near_ties((2, 16, 16, 16, 1)))
    assert sum(slab_spy.values()) == 0, slab_spy
    assert max(result["grads"].values()) == 0.0  # without slabs the wrapped model is bit-identical


@pytest.mark.parametrize("dtype_policy", ["float64"], indirect=True)
def test_float64_differences_are_rounding(dtype_policy, slab_spy):
    """In float64 every difference shrinks to ~1e-12 or below: the slab gradient is the plain gradient."""
    keras.utils.set_random_seed(SEED)
    model = halo_stack()
    rng = np.random.default_rng(5)
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB),
                          rng.random((2, 24, 12, 3)))
    assert slab_spy["backward"] >= 4
    assert max(result["grads"].values()) <= 1e-12, result["grads"]
    assert result["loss"] <= 1e-12 and result["outputs"] <= 1e-12
    model = models.unet2d(size=32)  # BatchNorm statistics summed over slabs
    result = compare_step(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB),
                          rng.random((4, 32, 32, 1)))
    assert max(result["grads"].values()) <= 1e-12, result["grads"]
    assert max(result["state"].values()) <= 1e-12, result["state"]
    # exact-row convolutions (slab_rows), over a concatenation too, with fused BatchNorm -> ReLU chains
    model = bn_unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    result = compare_step(model, wrapped, rng.random((4, 32, 32, 1)))
    assert max(result["grads"].values()) <= 1e-12, result["grads"]
    assert max(result["state"].values()) <= 1e-12, result["state"]
    assert result["loss"] <= 1e-12 and result["outputs"] <= 1e-12


def test_same_convolutions_compute_exactly_their_slab_rows(slab_spy, monkeypatch):
    """slab_rows: the U-Net's "same" convolutions (over a concatenation too) are planned exact, their backward
    windows are the forward's; the control (EXACT_ROWS off) plans none and still matches the plain model."""
    from keras_lms.offload.tensorflow import slab_plan

    plans = []
    backward = tf_slabs.backward

    def recording_backward(plan, *args, **kwargs):
        plans.append(plan)
        return backward(plan, *args, **kwargs)

    monkeypatch.setattr(tf_slabs, "backward", recording_backward)
    keras.utils.set_random_seed(SEED)
    model = bn_unet2d()
    x = images(size=32, channels=1, rng=np.random.default_rng(SEED))
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB), x, tol=SLAB_TOL)
    exact = [p for p in plans if p.exact_rows]
    assert len(exact) >= 4 and all(p.halo == 1 for p in exact), plans
    assert all(p.backward_window(*b) == p.forward_window(*b) for p in exact for b in p.bounds)
    plans.clear()
    monkeypatch.setattr(slab_plan, "EXACT_ROWS", False)
    assert_matches(model, keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB), x, tol=SLAB_TOL)
    assert plans and not any(p.exact_rows for p in plans)
    assert any(p.backward_window(*p.bounds[1]) != p.forward_window(*p.bounds[1]) for p in plans if p.halo)


def _fit_one_step(model, candidate, x, y, start):
    """Restore ``start``, compile (mixed precision: Keras wraps SGD in a LossScaleOptimizer), fit one batch;
    returns (loss, the change of every variable of ``model`` in float64)."""
    restore(model, start)
    candidate.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    loss = candidate.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False).history["loss"][0]
    after = snapshot(model)
    restore(model, start)
    return loss, [a.astype("float64") - s for a, s in zip(after, start)]


def _norm(parts):
    return float(np.sqrt(sum(np.sum(np.square(p)) for p in parts)))


MIXED_X = images(size=32, channels=1, rng=np.random.default_rng(1))
MIXED_Y = (np.random.default_rng(2).random((4, 32, 32, 1)) > 0.5).astype("float32")


def test_mixed_precision_loss_scaled_step_with_batchnorm_and_dropout(mixed_precision, slab_spy):
    """One loss-scaled `fit` step of a U-Net with BatchNorm and Dropout, plain vs slabs: same loss, moving
    statistics, Dropout seed state, and weight updates within float16 rounding.

    Measured: loss and moving statistics agree to ~1e-5; the weight updates to ~2% (norm over all weights).
    That is half-precision rounding, not the slabs: TensorFlow's CPU float16 convolutions accumulate in half
    precision, so any change of summation order moves a kernel gradient by percents (the plain float16 step is
    itself 2-11% per kernel away from the same step in float32; see the test below).
    """
    keras.utils.set_random_seed(SEED)
    model = build_unet((32, 32, 1), depth=2, base_filters=4, dropout=0.2)  # 2D: no float16 MaxPool3D on CPU
    assert any(isinstance(layer, keras.layers.Dropout) for layer in model.layers)
    start = snapshot(model)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB)
    loss_p, plain = _fit_one_step(model, model, MIXED_X, MIXED_Y, start)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    loss_w, slabbed = _fit_one_step(model, wrapped, MIXED_X, MIXED_Y, start)
    assert slab_spy["backward"] >= 4 and slab_spy["moments"] >= 1
    assert abs(loss_p - loss_w) <= 1e-3 * abs(loss_p)
    for v, p, w in zip(model.variables, plain, slabbed):
        if "moving" in v.path or "seed" in v.path:
            assert np.linalg.norm(p - w) <= 1e-4 * max(np.linalg.norm(p), 1e-12), v.path
    weights = [i for i, v in enumerate(model.variables) if v.trainable]
    difference = _norm([plain[i] - slabbed[i] for i in weights]) / _norm([plain[i] for i in weights])
    assert difference <= 0.05, difference


@pytest.mark.parametrize("profile", [None, "h100-pcie5"])
def test_mixed_precision_slabs_add_no_error_beyond_float16(mixed_precision, slab_spy, profile):
    """Against the same step in float32 (no Dropout, so the random draws cannot differ between policies), the
    slab-computed float16 step is as close as the plain float16 step: measured 0.0217 vs 0.0199. With the
    time-aware plan on a PCIe profile (tensors recomputed in windows instead of copied) as well."""
    wrapped = {}

    def wrap(model):
        wrapped["model"] = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes=SLAB, device_profile=profile)
        return wrapped["model"]

    plain_error, slab_error = float16_step_errors(wrap)
    assert slab_spy["backward"] >= 4
    recomputed = sum(e.recomputed_output for e in wrapped["model"].lms_plan)
    assert (recomputed >= 2) if profile else (recomputed == 0), wrapped["model"].lms_plan
    assert 0 < plain_error < 0.1 and slab_error <= 1.25 * plain_error, (plain_error, slab_error)


def float16_step_errors(wrap) -> tuple:
    """(plain, wrapped) relative distance of a float16 ``fit`` step's weight updates from the same step in
    float32, for a 2D U-Net without Dropout (the random draws cannot differ between policies); ``wrap(model)``
    wraps the mixed_float16 model. Leaves the policy at mixed_float16 (the ``mixed_precision`` fixture's)."""
    build = lambda: build_unet((32, 32, 1), depth=2, base_filters=4, dropout=0.0)  # noqa: E731
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(SEED)
    reference_model = build()
    start = snapshot(reference_model)
    _, reference = _fit_one_step(reference_model, reference_model, MIXED_X, MIXED_Y, start)
    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    _, plain = _fit_one_step(model, model, MIXED_X, MIXED_Y, start)
    _, candidate = _fit_one_step(model, wrap(model), MIXED_X, MIXED_Y, start)
    scale = _norm(reference)
    return (_norm([p - r for p, r in zip(plain, reference)]) / scale,
            _norm([w - r for w, r in zip(candidate, reference)]) / scale)


# ------------------------------------------------------------------------------------------- pure logic
def test_slab_bounds_cover_the_axis_and_align():
    assert tf_slabs.slab_bounds(10, 3) == ((0, 3), (3, 7), (7, 10))
    bounds = tf_slabs.slab_bounds(96, 5, align=2)
    assert bounds[0][0] == 0 and bounds[-1][1] == 96 and all(a % 2 == 0 for a, _ in bounds)
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("layer, halo", [
    (keras.layers.Conv3D(4, 3, padding="same"), 1),
    (keras.layers.Conv2D(4, 5, padding="same", dilation_rate=3), 6),
    (keras.layers.Conv2D(4, 1), 0),
    (keras.layers.Conv2D(4, 3), None),  # "valid": output rows shift
    (keras.layers.Conv2D(4, 3, strides=2, padding="same"), None),
    (keras.layers.Conv2D(4, 2, padding="same"), None),  # even kernel: asymmetric halo
    (keras.layers.Dropout(0.5), None),  # masks are drawn for the whole tensor
    (keras.layers.BatchNormalization(), 0),
    (keras.layers.BatchNormalization(axis=1), None),
    (keras.layers.ReLU(), 0),
    (keras.layers.Activation("softmax"), None),  # not element-wise
    (keras.layers.MaxPooling2D(), 0),
    (keras.layers.MaxPooling2D(3, strides=2), None),  # overlapping windows
])
def test_which_layers_are_cut_into_slabs(layer, halo):
    assert layer_facts.slab_halo(layer, 4) == halo


@pytest.mark.parametrize("layer, exact", [
    (keras.layers.Conv3D(4, 3, padding="same"), True),
    (keras.layers.Conv2D(4, (5, 3), padding="same", use_bias=False), True),
    (keras.layers.Conv1D(4, 3, padding="same"), True),
    (keras.layers.Conv2D(4, 3, padding="same", activation="relu"), False),  # the input gradient reads the output
    (keras.layers.Conv2D(4, 3, padding="same", dilation_rate=2), False),
    (keras.layers.Conv2D(4, (3, 2), padding="same"), False),  # even kernel: asymmetric padding
    (keras.layers.Conv2D(4, 3, padding="same", groups=2), False),
    (keras.layers.Conv2DTranspose(4, 3, padding="same"), False),
    (keras.layers.DepthwiseConv2D(3, padding="same"), False),
    (keras.layers.BatchNormalization(), False),
])
def test_which_convolutions_compute_exact_rows(layer, exact):
    from keras_lms.offload.tensorflow import slab_plan

    assert slab_plan.computes_exact_rows(layer) == exact


def test_plan_slabs_sizes():
    conv = keras.layers.Conv3D(4, 3, padding="same")
    assert tf_slabs.plan_slabs(conv, [[1, 64, 8, 8, 4]], 1000, 0) is None  # slabs off
    assert tf_slabs.plan_slabs(conv, [[1, 64, 8, 8, 4]], 1000, 1000) is None  # not larger than a slab
    plan = tf_slabs.plan_slabs(conv, [[1, 64, 8, 8, 4]], 4000, 1000)
    assert plan.count == 4 and plan.halo == 1 and not plan.moments
    pool = keras.layers.MaxPooling3D()
    plan = tf_slabs.plan_slabs(pool, [[1, 10, 8, 8, 4]], 4000, 1000)
    assert plan.stride == 2 and all(a % 2 == 0 and b % 2 == 0 for a, b in plan.bounds)
    assert tf_slabs.plan_slabs(pool, [[1, 9, 8, 8, 4]], 4000, 1000) is None  # the pooling drops a row


def test_plan_slabs_cuts_a_widening_convolution_by_its_output():
    """A first convolution (1 -> 16 channels) has a small input and a large output: it is cut by the larger side,
    so that its output can be recomputed window by window from the small input (recompute_candidates)."""
    conv = keras.layers.Conv3D(16, 3, padding="same")
    assert tf_slabs.plan_slabs(conv, [[1, 64, 8, 8, 1]], 1000, 2000) is None  # control: the input alone fits
    plan = tf_slabs.plan_slabs(conv, [[1, 64, 8, 8, 1]], 1000, 2000, output_bytes=16000)
    assert plan.count == 8 and plan.halo == 1
    pool = keras.layers.MaxPooling3D()  # only convolutions compute their forward in slabs: others ignore it
    assert tf_slabs.plan_slabs(pool, [[1, 64, 8, 8, 1]], 1000, 2000, output_bytes=16000) is None
