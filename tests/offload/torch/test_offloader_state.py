"""Each wrapped model owns its offloader state on torch (issue 20, finding 1): its host buffer pool, its transfer
counters and its settings (``keras_lms.offload.torch.offloader``).

Two wrapped models in one process, a GAN (generator and discriminator trained alternately with
``train_on_batch``) and two models trained alternately, still train exactly like their plain twins, and:

* each model's counters grow by what the process moved during that model's own steps, and not at all during the
  other's;
* neither model's step evicts the other's pooled host buffers: after two warm-up rounds no host buffer is
  allocated any more;
* settings given to one model do not change the other, and the package attributes stay the defaults.

Negative controls put the shared state back (one pool, one counter for both models): the checks then fail.
"""

import gc

import keras
import numpy as np
import pytest
import torch
from keras import layers

import keras_lms
from keras_lms.offload import torch as lms_torch
from tests import models
from tests.oracle import relative_error

pytestmark = pytest.mark.torch

WARM_UP = 2
ROUNDS = 3
COUNTED = ("d2h_bytes", "h2d_bytes", "d2h_copies", "h2d_copies", "offloaded_calls")


# ----------------------------------------------------------------------------------------------------- the GAN
class _Ref:
    """Holds the critic without Keras tracking it (its weights must not become the generator's)."""

    def __init__(self, model):
        self.model = model


class Generator(keras.Model):
    """A generator whose train_step takes the non-saturating GAN loss through a frozen critic (Keras' guide's
    torch pattern: zero_grad, backward, ``.grad``, ``optimizer.apply``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="g_loss")
        self.critic = None

    def train_step(self, data):
        z = data[0]  # (z, labels, sample weights): the loss needs only z
        self.zero_grad()
        logits = self.critic.model(self(z, training=True), training=False)
        loss = keras.ops.mean(keras.ops.softplus(-logits))
        loss.backward()
        grads = [v.value.grad for v in self.trainable_variables]
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"g_loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def _generator():
    z = keras.Input((8,))
    x = layers.Dense(64, activation="relu")(z)
    x = layers.Dense(8 * 8 * 4)(x)
    x = layers.Reshape((8, 8, 4))(x)
    x = layers.Conv2DTranspose(8, 2, strides=2, padding="same", activation="relu")(x)
    out = layers.Conv2D(1, 3, padding="same", activation="tanh")(x)
    return Generator(z, out, name="generator")


def _discriminator():
    image = keras.Input((16, 16, 1))
    x = layers.Conv2D(6, 3, padding="same", activation="relu")(image)
    x = layers.BatchNormalization()(x)
    x = layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(x)
    x = layers.Flatten()(x)
    return keras.Model(image, layers.Dense(1)(x), name="discriminator")


def _twins(build, wrap):
    """``build()`` with seeded weights, wrapped (every call offloaded) or not."""
    keras.utils.set_random_seed(0)
    model = build()
    return keras_lms.wrap(model, min_bytes=0, keep_last=0) if wrap else model


def _gan(wrap):
    """The phases of one GAN round, each a (name, model, step function): the discriminator's, the generator's."""
    gen, disc = _twins(_generator, wrap), _twins(_discriminator, wrap)
    inner = keras_lms.unwrap(gen) if wrap else gen
    inner.critic = _Ref(disc)  # the critic the generator trains against: the (wrapped) discriminator
    gen.compile(optimizer=keras.optimizers.SGD(0.05))
    disc.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    real = np.tanh(rng.normal(size=(64, 16, 16, 1))).astype("float32")
    state = {"i": 0}
    labels = np.concatenate([np.ones((4, 1)), np.zeros((4, 1))]).astype("float32")

    def disc_step():
        i = state["i"]
        z = rng.normal(size=(4, 8)).astype("float32")
        fake = keras.ops.convert_to_numpy(gen(z, training=False))
        disc.train_on_batch(np.concatenate([real[4 * i % 64:][:4], fake]), labels)

    def gen_step():
        z = rng.normal(size=(6, 8)).astype("float32")
        gen.train_on_batch(z, np.ones((6, 1), "float32"))
        state["i"] += 1

    return [("discriminator", disc, disc_step), ("generator", gen, gen_step)]


def _alternating(wrap):
    """Two models trained alternately with train_on_batch (other batch sizes, so no pool key is shared)."""
    a, b = _twins(models.resnet_blocks, wrap), _twins(models.cnn_bn_dropout, wrap)
    for m in (a, b):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(1)

    def step(model, batch, classes):
        return lambda: model.train_on_batch(rng.random((batch, 16, 16, 3)).astype("float32"),
                                            rng.random((batch, classes)).astype("float32"))

    return [("resnet_blocks", a, step(a, 4, 4)), ("cnn_bn_dropout", b, step(b, 6, 3))]


SCENARIOS = {"gan": _gan, "alternating": _alternating}


def _run(phases, rounds):
    for _ in range(rounds):
        for _, _, step in phases:
            step()


def _offloaders(phases):
    return {name: lms_torch.offloader_of(model) for name, model, _ in phases}


def _weights(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


# ----------------------------------------------------------------------------------------------------- checks
def _phase_deltas(phases, offloaders):
    """Run one round; for each phase, how much each model's counters and the process-wide total grew."""
    deltas = []
    for name, _, step in phases:
        before = {k: o.transfer_stats() for k, o in offloaders.items()}
        total = lms_torch.transfer_stats()
        step()
        after = {k: o.transfer_stats() for k, o in offloaders.items()}
        grown = {k: {c: after[k][c] - before[k][c] for c in COUNTED} for k in offloaders}
        grown["total"] = {c: lms_torch.transfer_stats()[c] - total[c] for c in COUNTED}
        deltas.append((name, grown))
    return deltas


def _own_bytes_problems(deltas, offloaders):
    """What breaks 'each model's counters count only its own bytes'."""
    problems = []
    for name, grown in deltas:
        if grown["total"]["d2h_bytes"] <= 0:
            problems.append(f"{name}: nothing offloaded")
        if grown[name] != grown["total"]:
            problems.append(f"{name}'s counters grew by {grown[name]} during its step, the process by {grown['total']}")
        for other in offloaders:
            if other != name and any(grown[other].values()):
                problems.append(f"{other}'s counters grew during {name}'s step: {grown[other]}")
    return problems


def _new_allocations(phases, pools):
    """Host buffers allocated during ROUNDS rounds after the warm-up (per pool), and buffers still lent."""
    _run(phases, WARM_UP)
    before = {k: p.allocations for k, p in pools.items()}
    _run(phases, ROUNDS)
    gc.collect()
    return {k: p.allocations - before[k] for k, p in pools.items()}, {k: p.lent for k, p in pools.items()}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_wrapped_models_train_like_their_plain_twins(scenario):
    results, start = {}, None
    for wrap in (False, True):
        phases = SCENARIOS[scenario](wrap)
        start = [_weights(model) for _, model, _ in phases]
        keras.utils.set_random_seed(1)  # the same Dropout masks for both twins
        _run(phases, WARM_UP + ROUNDS)
        results[wrap] = [_weights(model) for _, model, _ in phases]
    for plain, wrapped, initial in zip(results[False], results[True], start):
        assert len(plain) == len(wrapped) > 0
        errors = [relative_error(a, b) for a, b in zip(plain, wrapped)]
        assert max(errors) <= 1e-5, errors
        assert any(not np.array_equal(a, b) for a, b in zip(wrapped, initial))  # it trained


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_model_owns_its_pool_and_counters(scenario):
    phases = SCENARIOS[scenario](True)
    offloaders = _offloaders(phases)
    assert len({id(o) for o in offloaders.values()}) == 2
    assert len({id(o.pool) for o in offloaders.values()}) == 2
    assert all(o.pool is not lms_torch.host_pool() for o in offloaders.values())
    new, lent = _new_allocations(phases, {k: o.pool for k, o in offloaders.items()})
    assert new == {k: 0 for k in offloaders}, f"host buffers allocated after the warm-up: {new}"
    assert lent == {k: 0 for k in offloaders}
    assert all(o.pool.allocations > 0 for o in offloaders.values())
    assert not _own_bytes_problems(_phase_deltas(phases, offloaders), offloaders)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_negative_control_the_shared_pool_and_counter_fail_the_checks(scenario):
    """Put the process-wide state back (both models step with one pool and one counter): the generator's and the
    discriminator's (the two models') steps evict each other's buffers, and count each other's bytes."""
    phases = SCENARIOS[scenario](True)
    offloaders = _offloaders(phases)
    shared_pool, shared_stats = lms_torch.HostBufferPool(pin=False), lms_torch.TransferCounter()
    for offloader in offloaders.values():
        offloader.pool, offloader.stats = shared_pool, shared_stats
    new, _ = _new_allocations(phases, {"shared": shared_pool})
    assert new["shared"] > 0  # every step allocates again what the other model's step evicted
    assert _own_bytes_problems(_phase_deltas(phases, offloaders), offloaders)


def test_settings_given_to_one_model_do_not_change_the_other(monkeypatch):
    oa, ob = _offloaders(_alternating(True)).values()
    defaults = {"cpu_host_copies": True, "max_inflight_bytes": 256 << 20}  # the package's (CPU_HOST_COPIES: conftest)
    assert oa.settings() == ob.settings() == defaults
    oa.cpu_host_copies, oa.max_inflight_bytes = False, 1 << 20
    assert oa.settings() == {"cpu_host_copies": False, "max_inflight_bytes": 1 << 20}
    assert ob.settings() == defaults
    assert lms_torch.CPU_HOST_COPIES is True and lms_torch.MAX_INFLIGHT_BYTES == 256 << 20
    # The package attributes stay the defaults of a model without its own setting, read when its step starts.
    monkeypatch.setattr(lms_torch, "MAX_INFLIGHT_BYTES", 64 << 20)
    monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", False)
    assert ob.settings() == {"cpu_host_copies": False, "max_inflight_bytes": 64 << 20}
    assert oa.settings() == {"cpu_host_copies": False, "max_inflight_bytes": 1 << 20}


@pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_host_copies applies only without CUDA")
def test_one_models_copy_setting_leaves_the_others_steps_alone(monkeypatch):
    phases = _alternating(True)
    oa, ob = _offloaders(phases).values()
    oa.cpu_host_copies = False
    _run(phases, 2)
    assert oa.transfer_stats()["d2h_copies"] == 0 and oa.transfer_stats()["offloaded_calls"] > 0  # no copies
    assert ob.transfer_stats()["d2h_copies"] > 0 and oa.pool.allocations == 0 < ob.pool.allocations
    monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", False)  # the default: the model without its own follows
    before = ob.transfer_stats()["d2h_copies"]
    _run(phases, 1)
    assert ob.transfer_stats()["d2h_copies"] == before
    oa.cpu_host_copies = True  # its own setting wins over the package default
    _run(phases, 1)
    assert oa.transfer_stats()["d2h_copies"] > 0 and ob.transfer_stats()["d2h_copies"] == before


def test_a_step_uses_its_models_settings_in_the_transfer():
    wrapped = _twins(models.resnet_blocks, True)
    offloader = lms_torch.offloader_of(wrapped)
    offloader.max_inflight_bytes = 12345
    seen = []
    transfer = lms_torch.StepContext.transfer

    def spy(self, device):
        t = transfer(self, device)
        seen.append((t.max_inflight_bytes, t.copies, t.pool is offloader.pool))
        return t

    lms_torch.StepContext.transfer = spy
    try:
        wrapped(torch.rand(2, 16, 16, 3), training=True).sum().backward()
    finally:
        lms_torch.StepContext.transfer = transfer
    assert seen and set(seen) == {(12345, True, True)}


def test_offloader_of_needs_a_wrapped_model():
    model = models.resnet_blocks()
    with pytest.raises(TypeError, match="wrapped model"):
        lms_torch.offloader_of(model)
    wrapped = keras_lms.wrap(model)
    assert lms_torch.offloader_of(wrapped) is lms_torch.offloader_of(wrapped.lms_structure)
    assert lms_torch.offloader_of(keras_lms.wrap(model)) is not lms_torch.offloader_of(wrapped)


def test_clear_host_pool_clears_every_models_pool():
    wrapped = _twins(models.resnet_blocks, True)
    wrapped(torch.rand(2, 16, 16, 3), training=True).sum().backward()
    gc.collect()
    pool = lms_torch.offloader_of(wrapped).pool
    assert pool.idle_bytes() > 0
    lms_torch.clear_host_pool()
    assert pool.idle_bytes() == 0
