"""Tests of the segmentation examples (examples/): model builder, data, metrics, and tiny end-to-end runs.

The two scripts run as subprocesses (16^3 volumes / 32^2 images, 2 steps, LMS on); the 3D and 2D runs start
together so the file stays well under 90 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import models as bench_models
from examples import callbacks, cli, data, files, metrics, runtime, state, synthetic, train
from examples.unet import build_unet

pytestmark = pytest.mark.tensorflow(reason="the examples run on TensorFlow (tf.data loaders, TensorFlow subprocesses)")

REPO = pathlib.Path(__file__).resolve().parents[1]

RUN_TIMEOUT = 300
HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
SUMMARY_KEYS = {"final_dice", "final_iou", "final_loss", "samples_per_s", "peak_device_mib", "peak_host_rss_mib",
                "offloaded_mib_per_step", "epochs_completed", "initial_epoch", "ranks", "global_batch_size",
                "activation_report", "artefacts"}
PNGS = ("training_curves.png", "activation_report.png", "sample_prediction.png")


# ------------------------------------------------------------------------------------------- model builder
@pytest.mark.parametrize("shape,depth,channels", [((16, 16, 16, 1), 3, 1), ((32, 32, 3), 2, 1), ((32, 32, 3), 4, 3)])
def test_unet_shapes(shape, depth, channels):
    model = build_unet(shape, classes=channels, depth=depth, base_filters=2)
    assert model.output_shape == (None,) + shape[:-1] + (channels,)
    assert model.name == f"unet{len(shape) - 1}d"
    out = np.asarray(model(np.zeros((1,) + shape, "float32")))
    assert out.shape == (1,) + shape[:-1] + (channels,)
    if channels > 1:  # softmax over classes
        np.testing.assert_allclose(out.sum(axis=-1), 1.0, rtol=1e-5)
    else:  # sigmoid
        assert ((out > 0) & (out < 1)).all()


def test_unet_options():
    plain = build_unet((16, 16, 1), depth=2, base_filters=2, batch_norm=False, dropout=0.0, name="n")
    names = [layer.__class__.__name__ for layer in plain.layers]
    assert "BatchNormalization" not in names and "Dropout" not in names and plain.name == "n"
    full = build_unet((16, 16, 1), depth=2, base_filters=2)
    names = [layer.__class__.__name__ for layer in full.layers]
    assert "BatchNormalization" in names and "Dropout" in names


def test_unet_divisibility_error():
    with pytest.raises(ValueError, match="divisible by 2\\*\\*depth = 8"):
        build_unet((20, 20, 20, 1), depth=3)
    with pytest.raises(ValueError, match="input_shape"):
        build_unet((16, 1), depth=1)


def _layer_configs(model) -> list:
    return [(layer.__class__.__name__, layer.get_config()) for layer in model.layers]


@pytest.mark.parametrize("shape,kwargs", [
    ((32, 32, 3), dict(depth=2, base_filters=4)),
    ((16, 16, 16, 1), dict(depth=3, base_filters=2, classes=2, batch_norm=False, dropout=0.0, bn_momentum=0.9)),
])
def test_benchmark_unet_is_the_example_unet(shape, kwargs):
    """benchmarks/models.py's U-Net (the model docs/benchmarks.md measured) builds exactly the example's layers."""
    example = build_unet(shape, **kwargs)
    bench = bench_models.build_unet(shape, **kwargs)
    assert bench.name == example.name and _layer_configs(bench) == _layer_configs(example)
    # Negative control: one changed argument in either copy (here the filters) makes the comparison fail.
    changed = bench_models.build_unet(shape, **dict(kwargs, base_filters=2 * kwargs["base_filters"]))
    assert _layer_configs(changed) != _layer_configs(example)


def test_parse_args_rejects_indivisible_size(capsys):
    task = cli.Task("segmentation_3d", "3d", "--volume", 96, 3, "test")
    with pytest.raises(SystemExit):
        cli.parse_args(task, ["--volume", "20"])
    assert "divisible by 2**depth = 8" in capsys.readouterr().err
    args = cli.parse_args(task, ["--volume", "32", "--budget", "6GiB", "--no-lms", "--min-bytes", "0"])
    assert args.lms is True  # a budget implies LMS
    assert runtime.wrap_kwargs(args) == {"min_bytes": 0, "device_budget": "6GiB"}
    args = cli.parse_args(task, ["--volume", "32", "--slab-bytes", "128MiB"])
    assert runtime.wrap_kwargs(args) == {"slab_bytes": "128MiB"}
    assert runtime.wrap_kwargs(cli.parse_args(task, ["--volume", "32", "--slab-bytes", "0"])) == {"slab_bytes": 0}


# ------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("shape,channels", [((16, 16, 16), 1), ((32, 32), 3)])
def test_synthetic_shapes_dtypes_labels(shape, channels):
    ds = synthetic.SyntheticLesions(shape, channels, batch_size=3, steps=2, seed=1)
    assert len(ds) == 2
    x, y = ds[0]
    assert x.shape == (3,) + shape + (channels,) and x.dtype == np.float32
    assert y.shape == (3,) + shape + (1,) and y.dtype == np.float32
    assert set(np.unique(y)) <= {0.0, 1.0}
    fg = y.reshape(3, -1).mean(axis=1)
    assert (fg > 0).all() and (fg < 0.5).all()  # every sample has a lesion, none is mostly lesion
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05  # standardised
    # A real learning problem: lesions differ from background, but a global threshold does not solve it.
    inside, outside = x[..., 0][y[..., 0] > 0], x[..., 0][y[..., 0] == 0]
    assert abs(inside.mean() - outside.mean()) > 0.3
    best = max(_dice(np.abs(x[..., 0] - outside.mean()) > t, y[..., 0] > 0) for t in np.linspace(0.2, 3, 15))
    assert best < 0.8


def _dice(pred, truth):
    return 2 * (pred & truth).sum() / max(pred.sum() + truth.sum(), 1)


def test_synthetic_determinism_and_epochs():
    a = synthetic.SyntheticLesions((16, 16, 16), 1, 2, 2, seed=5)
    b = synthetic.SyntheticLesions((16, 16, 16), 1, 2, 2, seed=5)
    c = synthetic.SyntheticLesions((16, 16, 16), 1, 2, 2, seed=6)
    for i in range(2):
        np.testing.assert_array_equal(a[i][0], b[i][0])
        np.testing.assert_array_equal(a[i][1], b[i][1])
    assert not np.array_equal(a[0][0], c[0][0])
    first = a[0][0]
    a.on_epoch_end()  # the training split draws fresh samples every epoch ...
    assert not np.array_equal(first, a[0][0])
    b.set_epoch(1)  # ... reproducibly (set_epoch is what --resume uses)
    np.testing.assert_array_equal(a[0][0], b[0][0])
    val = synthetic.SyntheticLesions((16, 16, 16), 1, 2, 2, seed=5, split="val")
    before = val[0][0]
    val.on_epoch_end()  # validation is a fixed set, and differs from training
    np.testing.assert_array_equal(before, val[0][0])
    assert not np.array_equal(before, first)


def test_synthetic_rank_sharding_is_disjoint():
    size, steps, batch = 3, 4, 2
    shards = [synthetic.SyntheticLesions((16, 16), 1, batch, steps, seed=0, rank=r, size=size) for r in range(size)]
    ids = [{g for i in range(steps) for g in ds.sample_ids(i)} for ds in shards]
    assert all(len(s) == steps * batch for s in ids)
    assert set.union(*ids) == set(range(size * steps * batch))
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    first = [ds[0][0] for ds in shards]
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    with pytest.raises(ValueError, match="rank"):
        synthetic.SyntheticLesions((16, 16), 1, 2, 2, rank=2, size=2)


def test_pydataset_options_passed_through():
    ds = synthetic.SyntheticLesions((16, 16), 1, 2, 2, workers=3, use_multiprocessing=False, max_queue_size=5)
    assert (ds.workers, ds.use_multiprocessing, ds.max_queue_size) == (3, False, 5)
    import keras

    assert isinstance(ds, keras.utils.PyDataset)


def test_tf_dataset_has_static_shapes_and_follows_epochs():
    ds = synthetic.SyntheticLesions((16, 16), 3, batch_size=2, steps=3, seed=4)
    tf_ds = data.to_tf_dataset(ds, parallel_calls=2, prefetch=2)
    assert tuple(tf_ds.element_spec[0].shape) == (2, 16, 16, 3)  # static batch: keras-lms plans for it
    assert tuple(tf_ds.element_spec[1].shape) == (2, 16, 16, 1)
    batches = [(x.numpy(), y.numpy()) for x, y in tf_ds]
    assert len(batches) == 3
    for i, (x, y) in enumerate(batches):  # in order, identical to the PyDataset's batches
        np.testing.assert_array_equal(x, ds[i][0])
        np.testing.assert_array_equal(y, ds[i][1])
    ds.set_epoch(3)
    x3 = next(iter(tf_ds))[0].numpy()
    assert not np.array_equal(x3, batches[0][0])
    np.testing.assert_array_equal(x3, ds[0][0])


def test_crop_or_pad():
    a = np.arange(5 * 7, dtype=np.float32).reshape(5, 7, 1)
    out = files.crop_or_pad(a, (4, 4))
    assert out.shape == (4, 4, 1)
    np.testing.assert_array_equal(out[..., 0], a[0:4, 1:5, 0])  # centred crop
    np.testing.assert_array_equal(files.crop_or_pad(a, (4, 4), start=(1, 3))[..., 0], a[1:5, 3:7, 0])
    padded = files.crop_or_pad(a, (9, 7))
    assert padded.shape == (9, 7, 1) and padded[:2].sum() == 0 and padded[-2:].sum() == 0
    np.testing.assert_array_equal(padded[2:7], a)


def _volume_pair(rng, shape, channels=None):
    image = rng.normal(100, 10, size=shape + ((channels,) if channels else ())).astype(np.float32)
    label = np.zeros(shape, np.uint8)
    label[8:13, 9:14, 6:10] = 2  # BraTS-style non-binary label values
    image[8:13, 9:14, 6:10] += 50
    return image, label


def test_nifti_volumes(tmp_path):
    nib = pytest.importorskip("nibabel")
    rng = np.random.default_rng(0)
    for name, channels in (("a", None), ("b", None), ("c", None)):
        image, label = _volume_pair(rng, (20, 24, 14), channels)
        nib.save(nib.Nifti1Image(image, np.eye(4)), tmp_path / f"{name}_image.nii.gz")
        nib.save(nib.Nifti1Image(label, np.eye(4)), tmp_path / f"{name}_label.nii.gz")
    (tmp_path / "orphan_image.nii.gz").write_bytes(b"")  # no label: ignored
    pairs = files.find_pairs(tmp_path, files.NiftiVolumes.suffixes)
    assert [p[0].name for p in pairs] == ["a_image.nii.gz", "b_image.nii.gz", "c_image.nii.gz"]
    image, label = files.load_nifti(*pairs[0])
    assert image.shape == (20, 24, 14, 1) and label.shape == (20, 24, 14, 1) and image.dtype == np.float32
    assert set(np.unique(label)) == {0.0, 1.0} and int(label.sum()) == 5 * 5 * 4
    train_ds, val_ds, channels = data.make_datasets("3d", (16, 16, 16), data_dir=tmp_path, batch_size=2, seed=0)
    assert channels == 1 and len(train_ds.pairs) == 2 and len(val_ds.pairs) == 1
    x, y = val_ds[0]
    assert x.shape == (2, 16, 16, 16, 1) and y.shape == (2, 16, 16, 16, 1)
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert int(y[0].sum()) == 5 * 5 * 4  # validation crops are centred on the lesion (depth 14 is padded)
    x, y = train_ds[0]
    assert x.shape == (2, 16, 16, 16, 1) and set(np.unique(y)) <= {0.0, 1.0}
    # Rank sharding is file-wise.
    shards = [files.NiftiVolumes(pairs, (16, 16, 16), 1, 1, rank=r, size=2) for r in range(2)]
    assert {p[0].name for p in shards[0].pairs}.isdisjoint({p[0].name for p in shards[1].pairs})


def test_nifti_multichannel(tmp_path):
    nib = pytest.importorskip("nibabel")
    image, label = _volume_pair(np.random.default_rng(1), (18, 18, 16), channels=4)
    nib.save(nib.Nifti1Image(image, np.eye(4)), tmp_path / "p_image.nii.gz")
    nib.save(nib.Nifti1Image(label, np.eye(4)), tmp_path / "p_label.nii.gz")
    train_ds, _, channels = data.make_datasets("3d", (16, 16, 16), data_dir=tmp_path, batch_size=1)
    assert channels == 4 and train_ds[0][0].shape == (1, 16, 16, 16, 4)


def test_png_and_tiff_tiles(tmp_path):
    from PIL import Image

    tifffile = pytest.importorskip("tifffile")
    rng = np.random.default_rng(0)
    label = np.zeros((40, 30), np.uint8)
    label[10:20, 5:15] = 255
    rgb = rng.integers(0, 255, size=(40, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "t1_image.png")
    Image.fromarray(label).save(tmp_path / "t1_label.png")
    grey16 = rng.integers(0, 4000, size=(40, 30), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "t2_image.tif", grey16)
    tifffile.imwrite(tmp_path / "t2_label.tif", (label > 0).astype(np.uint8))
    pairs = files.find_pairs(tmp_path, files.IMAGE_SUFFIXES)
    assert [p[0].name for p in pairs] == ["t1_image.png", "t2_image.tif"]
    for pair in pairs:
        image, lab = files.load_tile(*pair)
        assert image.shape == (40, 30, 3) and image.dtype == np.float32  # grey TIFF replicated to RGB
        assert lab.shape == (40, 30, 1) and int(lab.sum()) == 100 and set(np.unique(lab)) == {0.0, 1.0}
    train_ds, val_ds, channels = data.make_datasets("2d", (32, 32), data_dir=tmp_path, batch_size=1,
                                                    val_fraction=0.5)
    assert channels == 3 and len(train_ds) == 1
    x, y = val_ds[0]
    assert x.shape == (1, 32, 32, 3) and y.shape == (1, 32, 32, 1) and int(y.sum()) == 100
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="NAME_image"):
        files.find_pairs(tmp_path / "empty", files.IMAGE_SUFFIXES)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        files.find_pairs(tmp_path / "missing", files.IMAGE_SUFFIXES)


# ---------------------------------------------------------------------------------------------- metrics
def test_dice_iou_exact_values():
    truth = np.array([1, 1, 0, 0, 1, 0], "float32").reshape(1, 6, 1)
    pred = np.array([0.9, 0.4, 0.6, 0.1, 0.51, 0.5], "float32").reshape(1, 6, 1)  # > 0.5: {0, 2, 4}
    dice, iou = metrics.Dice(), metrics.IoU()
    dice.update_state(truth, pred)
    iou.update_state(truth, pred)
    # |P & T| = 2 ({0, 4}), |P| = 3, |T| = 3
    assert float(dice.result()) == pytest.approx(2 * 2 / 6, abs=1e-7)
    assert float(iou.result()) == pytest.approx(2 / 4, abs=1e-7)
    # Accumulates over batches (the epoch), not a mean of batch values.
    truth2 = np.zeros((1, 6, 1), "float32")
    truth2[0, :4] = 1
    pred2 = np.full((1, 6, 1), 0.9, "float32")  # P = all 6, T = 4, I = 4
    dice.update_state(truth2, pred2)
    iou.update_state(truth2, pred2)
    assert float(dice.result()) == pytest.approx(2 * 6 / (9 + 7), abs=1e-7)
    assert float(iou.result()) == pytest.approx(6 / (9 + 7 - 6), abs=1e-7)
    dice.reset_state()
    iou.reset_state()
    empty = np.zeros((2, 4, 4, 1), "float32")
    dice.update_state(empty, empty + 0.2)
    iou.update_state(empty, empty + 0.2)
    assert float(dice.result()) == 1.0 and float(iou.result()) == 1.0  # both empty: perfect agreement
    dice.update_state(empty + 1, empty)
    assert float(dice.result()) == 0.0
    assert metrics.Dice.from_config(metrics.Dice(threshold=0.3).get_config()).threshold == 0.3


def test_dice_bce_loss():
    rng = np.random.default_rng(0)
    truth = (rng.random((2, 8, 8, 8, 1)) > 0.8).astype("float32")
    loss = metrics.DiceBCELoss()
    good = float(loss(truth, np.clip(truth, 0.02, 0.98)))
    bad = float(loss(truth, np.full_like(truth, 0.5)))
    assert 0 < good < 0.2 < bad
    restored = metrics.DiceBCELoss.from_config(loss.get_config())
    assert float(restored(truth, np.clip(truth, 0.02, 0.98))) == pytest.approx(good)


def test_cosine_schedule():
    schedule = callbacks.cosine_schedule(1.0, warmup_epochs=2, epochs=6)
    assert schedule(0, 0.123) == 0.123 and schedule(1, 0.5) == 0.5  # warm-up epochs untouched
    assert schedule(2, 0.0) == pytest.approx(1.0)
    values = [schedule(e, 0.0) for e in range(2, 6)]
    assert values == sorted(values, reverse=True) and values[-1] > 0


def test_dry_run_saves_model_for_keras_lms_report(tmp_path, capsys):
    import keras

    task = cli.Task("segmentation_3d", "3d", "--volume", 96, 3, "test")
    totals = train.run(task, ["--volume", "16", "--base-filters", "2", "--batch-size", "3", "--min-bytes", "0",
                               "--dry-run", "--out", str(tmp_path)])
    assert totals["host_bytes_per_step"] > 0
    assert "keras-lms report" in capsys.readouterr().out
    model = keras.saving.load_model(tmp_path / "model.keras")
    import keras_lms

    assert isinstance(model, keras_lms.LMSModel) and model.inner_model.input_shape == (None, 16, 16, 16, 1)
    assert (tmp_path / "activation_report.png").stat().st_size > 1000
    assert not (tmp_path / state.CHECKPOINT).exists()


# ------------------------------------------------------------------------------------ end-to-end scripts
def _env():
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    return env


def _start(script, out, *extra):
    """``script``: a file in examples/ (``python examples/x.py``) or a module (``python -m examples.x``)."""
    entry = [str(REPO / "examples" / script)] if script.endswith(".py") else ["-m", script]
    cmd = [sys.executable, *entry, "--batch-size", "2", "--steps-per-epoch", "2",
           "--val-steps", "1", "--base-filters", "4", "--lms", "--min-bytes", "0", "--workers", "1",
           "--verbose", "2", "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"example timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-5000:]
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One epoch of each script, started together (two cores), then a resumed second 3D epoch (--elastic)."""
    base = tmp_path_factory.mktemp("examples")
    out3, out2 = base / "seg3d", base / "seg2d"
    p3 = _start("segmentation_3d.py", out3, "--volume", "16", "--epochs", "1")
    # The 3D runs cover the default tf.data loader and `python examples/x.py`, the 2D run Keras' PyDataset loader,
    # `python -m examples.x` and, where Horovod is installed, the --horovod code path on a single rank (plain
    # python: Horovod size 1).
    p2 = _start("examples.segmentation_2d", out2, "--image-size", "32", "--depth", "2", "--epochs", "1",
                "--loader", "pydataset", *(["--horovod"] if HAVE_HOROVOD else []))
    log3 = _finish(p3)
    first = json.loads((out3 / "summary.json").read_text())
    state1 = json.loads((out3 / state.STATE).read_text())
    # The resumed run takes the --elastic code path where Horovod is installed (one rank: hvd.elastic.run with a
    # KerasState starting at the resumed epoch; tests/horovod/test_horovod_elastic.py covers real resets).
    resumed = _finish(_start("segmentation_3d.py", out3, "--volume", "16", "--epochs", "2", "--resume",
                             *(["--elastic"] if HAVE_HOROVOD else [])))
    log2 = _finish(p2)
    return dict(out3=out3, out2=out2, log3=log3, log2=log2, first=first, state1=state1, resumed=resumed)


def _check_artefacts(out: pathlib.Path, summary: dict):
    from PIL import Image

    assert SUMMARY_KEYS <= set(summary)
    assert summary["final_dice"] is not None and 0 <= summary["final_dice"] <= 1
    assert summary["samples_per_s"] > 0 and summary["ranks"] == 1
    assert summary["offloaded_mib_per_step"] > 0  # --lms --min-bytes 0: something went to host
    totals = summary["activation_report"]
    assert {"device_activation_bytes_plain", "device_activation_bytes_wrapped", "host_bytes_per_step",
            "transfer_bytes_per_step"} <= set(totals)
    assert totals["device_activation_bytes_wrapped"] < totals["device_activation_bytes_plain"]
    for name in PNGS:
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            w, h = img.size
            assert 400 <= w <= 4000 and 250 <= h <= 3000, (name, img.size)
            assert np.asarray(img.convert("L")).std() > 5  # not a blank canvas
    assert (out / state.CHECKPOINT).stat().st_size > 10_000
    assert (out / "training_log.csv").read_text().startswith("epoch,")
    assert (out / "activation_report.txt").read_text().strip()


def test_segmentation_3d_artefacts(runs):
    first = runs["first"]
    _check_artefacts(runs["out3"], json.loads((runs["out3"] / "summary.json").read_text()))
    assert first["input_shape"] == [16, 16, 16, 1] and first["epochs_completed"] == 1
    assert runs["state1"]["epoch"] == 1 and [r["epoch"] for r in runs["state1"]["history"]] == [1]
    assert "segmentation_3d summary" in runs["log3"] and "final validation Dice" in runs["log3"]


def test_segmentation_2d_artefacts(runs):
    summary = json.loads((runs["out2"] / "summary.json").read_text())
    _check_artefacts(runs["out2"], summary)
    assert summary["input_shape"] == [32, 32, 3] and summary["epochs_completed"] == 1
    assert "segmentation_2d summary" in runs["log2"]


def test_resume_continues_from_saved_epoch(runs):
    import keras

    out = runs["out3"]
    assert "Resuming from" in runs["resumed"] and "after epoch 1" in runs["resumed"]
    assert "Epoch 2/2" in runs["resumed"] and "Epoch 1/2" not in runs["resumed"]
    saved = json.loads((out / state.STATE).read_text())
    assert saved["epoch"] == 2 and [r["epoch"] for r in saved["history"]] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["initial_epoch"] == 1 and summary["epochs_completed"] == 2
    rows = (out / "training_log.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[1].startswith("0,") and rows[2].startswith("1,")  # appended, not rewritten
    model = keras.saving.load_model(out / state.CHECKPOINT)
    assert int(model.optimizer.iterations) == 4  # optimizer state restored and continued (2 + 2 steps)


def test_summary_script_prints_the_run_summary(runs):
    """The last step of scripts/demo.sh: examples/summary.py prints, from summary.json, what the run printed."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "summary.py"), str(runs["out3"])], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.strip()
    assert "== segmentation_3d summary" in printed and printed in runs["resumed"]
