"""The examples when something goes wrong (issue 11): a bad flag is a usage error naming it, an interrupted
checkpoint leaves the previous one, --resume explains why it refuses, and a corrupt input file is named."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

from examples import callbacks, cli, files, state

TASK3D = cli.Task(name="segmentation_3d", kind="3d", size_flag="--volume", default_size=96, default_depth=3,
                  what="3D")


def test_volume_zero_names_the_volume_flag(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(TASK3D, ["--volume", "0", "--out", "/tmp"])
    err = capsys.readouterr().err
    assert "--volume must be >= 1" in err and "--size" not in err


def test_unwritable_out_is_a_usage_error(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SystemExit):
        cli.parse_args(TASK3D, ["--out", str(target / "run")])
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err and "Traceback" not in err
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SystemExit):
            cli.parse_args(TASK3D, ["--out", str(locked / "run")])
        assert "is not writable" in capsys.readouterr().err


def _small_model():
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1)(inp))


def test_checkpoint_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / state.CHECKPOINT
    model = _small_model()
    cb = callbacks.AtomicCheckpoint(path)
    cb.set_model(model)
    cb.on_epoch_end(0)
    good = path.read_bytes()

    def killed(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as fh:
            fh.write(b"PK half")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(keras.Model, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        cb.on_epoch_end(1)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [state.CHECKPOINT]


def _args(*argv):
    return cli.parse_args(TASK3D, ["--volume", "16", "--depth", "2", *argv])


def test_resume_detects_damaged_checkpoint(tmp_path):
    args = _args("--out", str(tmp_path))
    (tmp_path / state.CHECKPOINT).write_bytes(b"truncated")
    (tmp_path / state.STATE).write_text(json.dumps({"epoch": 1, "args": vars(args)}))
    with pytest.raises(state.ResumeError, match="damaged or incomplete.*Delete"):
        state.read_state(tmp_path, args, TASK3D)


def test_resume_refuses_other_model_flags(tmp_path):
    saved = _args("--out", str(tmp_path))
    _small_model().save(tmp_path / state.CHECKPOINT)
    (tmp_path / state.STATE).write_text(json.dumps({"epoch": 1, "args": vars(saved)}))
    assert state.read_state(tmp_path, saved, TASK3D)["epoch"] == 1
    other = cli.parse_args(TASK3D, ["--volume", "32", "--depth", "2", "--out", str(tmp_path)])
    with pytest.raises(state.ResumeError, match="--volume 16.*asks for 32.*Use --volume 16"):
        state.read_state(tmp_path, other, TASK3D)
    deeper = cli.parse_args(TASK3D, ["--volume", "16", "--depth", "3", "--out", str(tmp_path)])
    with pytest.raises(state.ResumeError, match="--depth 2"):
        state.read_state(tmp_path, deeper, TASK3D)


def test_corrupt_png_is_named(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    good = tmp_path / "a_image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(good)
    bad = tmp_path / "a_label.png"
    bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(files.DataFileError, match="cannot read .*a_label.png.*damaged or truncated"):
        files.load_tile(good, bad)


def test_corrupt_nifti_is_named(tmp_path):
    nib = pytest.importorskip("nibabel")
    img = tmp_path / "v_image.nii.gz"
    volume = np.random.default_rng(0).random((16, 16, 16)).astype(np.float32)
    nib.save(nib.Nifti1Image(volume, np.eye(4)), str(img))
    bad = tmp_path / "v_label.nii.gz"
    bad.write_bytes(img.read_bytes()[: len(img.read_bytes()) // 2])
    with pytest.raises(files.DataFileError, match="v_label.nii.gz"):
        files.load_nifti(img, bad)


def _tiles_with_one_corrupt_label(directory):
    from PIL import Image

    rng = np.random.default_rng(0)
    for stem in ("a", "b", "c"):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(directory / f"{stem}_image.png")
        Image.fromarray((rng.random((40, 40)) > 0.5).astype(np.uint8) * 255).save(directory / f"{stem}_label.png")
    bad = directory / "a_label.png"
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    return bad


@pytest.mark.parametrize("loader", ["tfdata", "pydataset"])
def test_corrupt_tile_is_one_line_under_both_loaders(tmp_path, loader):
    """A damaged PNG in --data-dir met while training: one line naming the file (SystemExit), not a
    PyFunc / IteratorGetNext traceback. Control: the tf.data error itself does not name the file on its first line."""
    pytest.importorskip("PIL")
    from examples import data

    bad = _tiles_with_one_corrupt_label(tmp_path)
    train, val, _ = data.make_datasets("2d", (32, 32), data_dir=str(tmp_path), batch_size=1, steps=2, val_steps=1,
                                       val_fraction=0.0)

    def read_all():
        if loader == "tfdata":
            for _ in data.to_tf_dataset(train):
                pass
        else:
            for i in range(len(train)):
                train[i]

    if loader == "tfdata":  # the control: what the user saw before
        import tensorflow as tf

        with pytest.raises(tf.errors.OpError) as raw:
            read_all()
        assert "PyFunc" in str(raw.value) or "pyfunc" in str(raw.value).lower()
        train.data_error = None
    with pytest.raises(data.DataError) as exited:
        with data.data_errors_in_one_line(train, val):
            read_all()
    message = str(exited.value)
    assert str(bad) in message and "damaged or truncated" in message and "\n" not in message, message
