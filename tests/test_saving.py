"""Saving a wrapped model (keras_lms/saving.py): no file lost, no format that cannot hold it, interchangeable weights.

A save that cannot succeed must fail before it touches the previous file, an interrupted save must leave it
whole, the legacy HDF5 format is refused with the format to use, and a `.weights.h5` file moves between the
wrapped and the plain model in both directions, optimizer state included (either backend).
"""

import keras
import numpy as np
import pytest

import keras_lms
from tests import models

RNG = np.random.default_rng(11)


def test_unsavable_settings_leave_the_previous_file_intact(tmp_path):
    wrapped = keras_lms.wrap(models.conv_chain(), exclude=lambda layer: layer.name == "head")
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
    wrapped = keras_lms.wrap(models.conv_chain())
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
    wrapped = keras_lms.wrap(models.conv_chain())
    with pytest.raises(ValueError, match=r"legacy HDF5.*\.keras"):
        wrapped.save(tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


@pytest.mark.parametrize("direction", ["wrapped_to_plain", "plain_to_wrapped"])
def test_weights_files_are_interchangeable(tmp_path, direction):
    x, y = models.conv_chain_data(8, rng=RNG)
    source, target = models.conv_chain(), models.conv_chain()
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
