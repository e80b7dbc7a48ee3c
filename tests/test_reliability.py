"""Reliability fixes of issue 11: nothing silently wrong, no lost file, clear errors (either backend)."""

import keras
import numpy as np
import pytest

import keras_lms

RNG = np.random.default_rng(11)


# ------------------------------------------------------------------------------- custom train steps
def _dense_net(cls, name):
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name=f"{name}_d1")(inp)
    h = keras.layers.Dense(16, activation="relu", name=f"{name}_d2")(h)
    out = keras.layers.Dense(2, name=f"{name}_out")(h)
    return cls(inp, out, name=name)


def _loss_and_gradients(model, compute):
    """``compute()`` and its gradients for ``model.trainable_variables``, as the Keras guide writes a custom
    train_step for each backend (``tf.GradientTape``; torch: ``zero_grad``, ``backward``, ``.grad``)."""
    if keras.backend.backend() == "torch":
        model.zero_grad()
        loss = compute()
        loss.backward()
        return loss, [v.value.grad for v in model.trainable_variables]
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = compute()
    return loss, tape.gradient(loss, model.trainable_variables)


def _apply(model, grads):
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            model.optimizer.apply(grads, model.trainable_variables)
    else:
        model.optimizer.apply(grads, model.trainable_variables)


class DoubleLossStep(keras.Model):
    """A custom train_step whose loss is twice the compiled loss."""

    def train_step(self, data):
        x, y = data
        y_pred = None

        def compute():
            nonlocal y_pred
            y_pred = self(x, training=True)
            return 2.0 * self.compute_loss(x=x, y=y, y_pred=y_pred)

        loss, grads = _loss_and_gradients(self, compute)
        _apply(self, grads)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class L1PlusLoss(keras.Model):
    """compute_loss overridden: adds the mean absolute prediction."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return base + 0.5 * keras.ops.mean(keras.ops.abs(y_pred))


class TrackerStep(keras.Model):
    """Own loss tracker, own metrics property, own test_step (the Keras guide's pattern)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="my_loss")

    def train_step(self, data):
        x, y = data
        loss, grads = _loss_and_gradients(self, lambda: keras.ops.mean((self(x, training=True) - y) ** 2) * 3.0)
        _apply(self, grads)
        self.tracker.update_state(loss)
        return {"my_loss": self.tracker.result()}

    def test_step(self, data):
        x, y = data
        loss = keras.ops.mean((self(x, training=False) - y) ** 2) * 3.0
        self.tracker.update_state(loss)
        return {"my_loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def _weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights]


@pytest.mark.parametrize("cls", [DoubleLossStep, L1PlusLoss, TrackerStep])
def test_custom_steps_train_exactly_like_the_plain_model(cls):
    x = RNG.random((32, 8)).astype("float32")
    y = RNG.random((32, 2)).astype("float32")
    plain = _dense_net(cls, "plain")
    wrapped_inner = _dense_net(cls, "inner")
    wrapped_inner.set_weights(plain.get_weights())
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    plain_hist = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    wrapped = keras_lms.wrap(wrapped_inner, min_bytes=0, keep_last=0)
    wrapped.compile(keras.optimizers.SGD(0.1), "mse")
    lms_hist = wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert sorted(lms_hist) == sorted(plain_hist)
    for key in plain_hist:
        np.testing.assert_allclose(lms_hist[key], plain_hist[key], rtol=1e-5)
    for a, b in zip(_weights(plain), _weights(wrapped_inner)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert any(e.offloaded for e in wrapped.lms_plan)  # the custom step's forward pass was offloaded
    assert wrapped.lms_plan[0].shapes == [(8, 8)]
    assert wrapped.delegates_steps
    if cls is TrackerStep:
        np.testing.assert_allclose(wrapped.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5)


def test_default_step_models_are_not_delegated():
    wrapped = keras_lms.wrap(_dense_net(keras.Model, "plain_default"))
    assert not wrapped.delegates_steps


# ---------------------------------------------------------------------------- unknown batch size
def _conv_net():
    inp = keras.Input((32, 32, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c3")(h)
    out = keras.layers.Conv2D(1, 1, name="head")(h)
    return keras.Model(inp, out)


def _images(n=20):
    x = RNG.random((n, 32, 32, 1)).astype("float32")
    return x, x


def _generator(batches):
    x, y = _images(sum(batches))
    start = 0
    for b in batches:
        yield x[start:start + b], y[start:start + b]
        start += b


def _tf_data(batch):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(_images()).batch(batch)  # no drop_remainder: None batch axis


# 8 samples x 32x32x8 float32 = 256 KiB per conv input; one sample = 32 KiB: min_bytes between the two.
@pytest.mark.parametrize("make_data", [
    pytest.param(lambda: _tf_data(8), marks=pytest.mark.tensorflow(reason="a tf.data pipeline")),
    lambda: _generator([8, 8, 4]),
], ids=["tfdata_no_drop_remainder", "generator"])
def test_unknown_batch_axis_plans_for_the_real_batch(make_data):
    reference = keras_lms.wrap(_conv_net(), min_bytes="100KiB", keep_last=1)
    reference.compile("sgd", "mse")
    x, y = _images(16)
    reference.fit(x, y, batch_size=8, epochs=1, verbose=0)
    wrapped = keras_lms.wrap(_conv_net(), min_bytes="100KiB", keep_last=1)
    wrapped.compile("sgd", "mse")
    wrapped.fit(make_data(), epochs=1, verbose=0)
    offloaded = [e.layer for e in wrapped.lms_plan if e.offloaded]
    assert offloaded == [e.layer for e in reference.lms_plan if e.offloaded] and offloaded
    # TensorFlow traces one step (batch axis None) and plans it for the largest batch seen (8); torch plans every
    # step for its own batch, and the last one had 4 samples.
    last_batch = 8 if keras.backend.backend() == "tensorflow" else 4
    assert wrapped.offloaded_bytes_per_step == reference.offloaded_bytes_per_step * last_batch // 8


def test_generator_with_a_larger_later_batch_is_replanned():
    wrapped = keras_lms.wrap(_conv_net(), min_bytes="100KiB", keep_last=1)
    wrapped.compile("sgd", "mse")
    wrapped.fit(_generator([2, 2, 2, 2, 8, 8, 8]), epochs=1, verbose=0)
    assert wrapped.batch_size_hint == 8
    assert any(e.offloaded for e in wrapped.lms_plan)


@pytest.mark.tensorflow(reason="a tf.data pipeline (an unknown batch axis in the traced step)")
def test_unknown_batch_axis_host_memory_guard(monkeypatch):
    from keras_lms import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 600 << 10)  # 600 KiB "free"
    wrapped = keras_lms.wrap(_conv_net(), min_bytes=0, keep_last=0)
    wrapped.compile("sgd", "mse")
    with pytest.raises(memory.HostMemoryError, match="host memory per step"):
        wrapped.fit(_tf_data(8), epochs=1, verbose=0)


# ---------------------------------------------------------------------------------------- saving
def test_unsavable_settings_leave_the_previous_file_intact(tmp_path):
    wrapped = keras_lms.wrap(_conv_net(), exclude=lambda layer: layer.name == "head")
    path = tmp_path / "c.keras"
    path.write_bytes(b"previous checkpoint")
    with pytest.raises(ValueError, match="predicate.*unwrap"):
        wrapped.save(path)
    assert path.read_bytes() == b"previous checkpoint"
    cb = keras.callbacks.ModelCheckpoint(str(path))
    cb.set_model(wrapped)
    with pytest.raises(ValueError, match="predicate"):
        cb.on_epoch_end(0, {})
    assert path.read_bytes() == b"previous checkpoint"


def test_save_is_atomic(tmp_path, monkeypatch):
    wrapped = keras_lms.wrap(_conv_net())
    path = tmp_path / "c.keras"
    wrapped.save(path)
    good = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    from keras.src.saving import saving_lib

    monkeypatch.setattr(saving_lib, "_save_model_to_fileobj", crash)
    with pytest.raises(KeyboardInterrupt):
        wrapped.save(path)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.keras"]  # no temporary file left


def test_h5_save_refused_naming_keras(tmp_path):
    wrapped = keras_lms.wrap(_conv_net())
    with pytest.raises(ValueError, match=r"legacy HDF5.*\.keras"):
        wrapped.save(tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


@pytest.mark.parametrize("direction", ["wrapped_to_plain", "plain_to_wrapped"])
def test_weights_files_are_interchangeable(tmp_path, direction):
    x, y = _images(8)
    source, target = _conv_net(), _conv_net()
    src = keras_lms.wrap(source) if direction == "wrapped_to_plain" else source
    dst = target if direction == "wrapped_to_plain" else keras_lms.wrap(target)
    for model in (src, dst):
        model.compile("adam", "mse")
    src.fit(x, y, batch_size=4, epochs=1, verbose=0)
    dst.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)  # built optimizer, other values
    path = tmp_path / "w.weights.h5"
    cb = keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True)
    cb.set_model(src)
    cb.on_epoch_end(0, {})
    dst.load_weights(path)
    for a, b in zip(source.get_weights(), target.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(src.optimizer.variables, dst.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


# --------------------------------------------------------------------------------- clear errors
def test_memory_callback_csv_path_checked_up_front(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*makedirs"):
        keras_lms.MemoryHighWaterMark(csv_path=tmp_path / "missing" / "mem.csv")
    with pytest.raises(TypeError, match="csv_path must be a file path.*file descriptor"):
        keras_lms.MemoryHighWaterMark(csv_path=123)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if not os.access(locked, os.W_OK):  # root can write anywhere
            with pytest.raises(PermissionError, match="not writable"):
                keras_lms.MemoryHighWaterMark(csv_path=locked / "mem.csv")
    finally:
        locked.chmod(0o700)


def test_memory_callback_second_run_appends_without_second_header(tmp_path):
    path = tmp_path / "mem.csv"
    x, y = _images(8)
    for _ in range(2):
        model = _conv_net()
        model.compile("sgd", "mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[keras_lms.MemoryHighWaterMark(csv_path=path)])
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("epoch,batch") and not lines[2].startswith("epoch")


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(link_gbps=0), ValueError, "link_gbps must be a positive number"),
    (dict(link_gbps=-3.0), ValueError, "link_gbps must be a positive number"),
    (dict(input_shape="abc"), ValueError, "input_shape must be one sample's shape"),
    (dict(input_shape=(32, 0, 1)), ValueError, "input_shape must be one sample's shape"),
    (dict(config={"min_bytes": 0}), TypeError, "config must be a keras_lms.LMSConfig"),
])
def test_report_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        keras_lms.report(_conv_net(), batch_size=2, **kwargs)


def test_report_accepts_numpy_input_shape():
    rep = keras_lms.report(_conv_net(), batch_size=2, input_shape=(np.int64(32), np.int64(32), np.int64(1)))
    assert rep.rows and rep.batch_size == 2


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "m.keras"
    _conv_net().save(path)
    return path


@pytest.mark.parametrize("extra,pattern", [
    (["--link-gbps", "0"], "--link-gbps must be a positive"),
    (["--input-shape", "a,b"], "--input-shape 'a,b' is not a shape.*128,128,128,1"),
    (["--plot", "/nonexistent/dir/r.png"], "--plot '/nonexistent/dir/r.png' cannot be written"),
])
def test_cli_errors_are_one_line(saved_model, capsys, extra, pattern):
    from keras_lms import cli

    assert cli.main(["report", str(saved_model), "--batch-size", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(pattern, err)


def test_cli_corrupt_keras_file(tmp_path, saved_model, capsys):
    from keras_lms import cli

    corrupt = tmp_path / "c.keras"
    corrupt.write_bytes(saved_model.read_bytes()[:200])
    assert cli.main(["report", str(corrupt), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "not a readable .keras file (damaged" in err and "File not found" not in err


def test_include_and_integer_like_settings():
    model = _conv_net()
    with pytest.raises(ValueError, match=r"include=\[\] selects no layer.*include=None"):
        keras_lms.wrap(model, include=[])
    with pytest.raises(TypeError, match="layer object 'c1'.*include=\\['c1'\\]"):
        keras_lms.wrap(model, include=[model.get_layer("c1")])
    with pytest.raises(TypeError, match="Layer indices are not accepted"):
        keras_lms.wrap(model, include=[2])
    wrapped = keras_lms.wrap(model, min_bytes=np.int64(5), keep_last=np.int32(0), prefetch=np.int64(2), exclude=[])
    assert wrapped.lms_config.min_bytes == 5 and type(wrapped.lms_config.min_bytes) is int
    assert wrapped.lms_config.keep_last == 0 and wrapped.lms_config.prefetch == 2
    assert wrapped.lms_config.exclude is None


@pytest.mark.tensorflow(reason="the error must cross a user's tf.function")
def test_host_memory_error_passes_through_user_tf_function(monkeypatch):
    import tensorflow as tf

    from keras_lms import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 10)
    wrapped = keras_lms.wrap(_conv_net(), min_bytes=0, keep_last=0)
    x = np.zeros((4, 32, 32, 1), "float32")

    @tf.function
    def step():
        return wrapped(x, training=True)

    with pytest.raises(memory.HostMemoryError, match="host memory per step"):
        step()
