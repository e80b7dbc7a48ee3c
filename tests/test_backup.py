"""keras_lms.callbacks.BackupAndRestore: SIGKILL at any point of a backup write, then an exact resume; Keras' own
callback under the same kills as the negative control; damaged backups; per-rank directories; atomic save_weights.

The SIGKILL runs are real processes (tests/backup_runs.py forks one per run from a process that imported Keras once)
and run once per session (`killed_runs`); the other tests work in this process on hand-made directories.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import h5py
import keras
import numpy as np
import pytest

import keras_lms
from keras_lms import backup_store
from keras_lms.backup import STATE, WEIGHTS
from keras_lms.callbacks import BackupAndRestore, BackupError
from tests.backup_runs import build, data

REPO = pathlib.Path(__file__).resolve().parents[1]
KILL = -9  # exit status of a run that killed itself with SIGKILL


# ------------------------------------------------------------------------------------------------ killed runs
def _plan(tmp: pathlib.Path) -> dict:
    ours, keras_dir, plain_dir = str(tmp / "ours"), str(tmp / "keras"), str(tmp / "plain")
    # Lane A: one directory, a wrapped model, killed at each point of the protocol in turn; each run resumes from
    # what the previous one left. kill_at counts this run's backups (save_freq=3, 4 batches per epoch).
    ours_lane = [
        dict(name="ref", out=str(tmp / "ref.npz")),
        dict(name="mid_weights", callback="keras_lms", dir=ours, kill="mid_weights", kill_at=2),
        dict(name="after_weights", callback="keras_lms", dir=ours, kill="after_weights", kill_at=2),
        dict(name="before_switch", callback="keras_lms", dir=ours, kill="before_switch", kill_at=2),
        dict(name="after_switch", callback="keras_lms", dir=ours, kill="after_switch", kill_at=1,
             snapshot=str(tmp / "ours_before_after_switch")),
        dict(name="final", callback="keras_lms", dir=ours, out=str(tmp / "final.npz"),
             snapshot=str(tmp / "ours_before_final")),
    ]
    # Lane B: plain models. Keras' callback (the negative control), save_weights killed mid-write, and keras_lms'
    # callback on a plain model.
    keras_lane = [
        dict(name="plain_ref", wrapped=False, out=str(tmp / "plain_ref.npz")),
        dict(name="keras_after_weights", wrapped=False, callback="keras", dir=keras_dir, kill="after_weights",
             kill_at=2),
        dict(name="keras_resumed", wrapped=False, callback="keras", dir=keras_dir, out=str(tmp / "keras.npz"),
             snapshot=str(tmp / "keras_after_kill")),
        dict(name="keras_mid_weights", wrapped=False, callback="keras", dir=str(tmp / "keras_mid"),
             kill="mid_weights", kill_at=2),
        dict(name="save_weights_wrapped", save_weights=str(tmp / "wrapped.weights.h5"), kill="mid_weights",
             kill_at=2),
        dict(name="save_weights_plain", wrapped=False, save_weights=str(tmp / "plain.weights.h5"),
             kill="mid_weights", kill_at=2),
        dict(name="plain_after_switch", wrapped=False, callback="keras_lms", dir=plain_dir, save_freq="epoch",
             kill="after_switch", kill_at=3),
        dict(name="plain_final", wrapped=False, callback="keras_lms", dir=plain_dir, save_freq="epoch",
             out=str(tmp / "plain.npz"), snapshot=str(tmp / "plain_before_final")),
    ]
    return {"lanes": [ours_lane, keras_lane], "results": str(tmp / "results.json")}


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed_runs")
    (tmp / "plan.json").write_text(json.dumps(_plan(tmp)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    # -m from the repository root: as a script, tests/ would come first on sys.path (a tests/ module could shadow
    # a library).
    proc = subprocess.run([sys.executable, "-m", "tests.backup_runs", str(tmp / "plan.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-5000:]
    statuses = json.loads((tmp / "results.json").read_text())
    return tmp, statuses, proc.stderr


def _npz(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_bit_identical(got: dict, ref: dict):
    names = [k for k in ref if k != "loss"]
    assert sorted(names) == sorted(k for k in got if k != "loss")
    for name in names:
        assert np.array_equal(got[name], ref[name]), f"{name} differs from the uninterrupted run"


def test_sigkill_at_each_point_of_a_backup_write_then_the_resumed_run_is_exact(killed_runs):
    tmp, statuses, stderr = killed_runs
    for name in ("mid_weights", "after_weights", "before_switch", "after_switch"):
        assert statuses[name] == KILL, (name, statuses, stderr[-3000:])
    assert statuses["final"] == 0 and statuses["ref"] == 0, stderr[-3000:]
    # After the switch, before the old backup was deleted: two complete backups, the run resumed from the newer
    # one, which ends epoch 2 (all of its batches are passed over, then epoch 3 starts).
    assert sorted(os.listdir(tmp / "ours_before_final")) == ["epoch-000002-step-000000001",
                                                             "epoch-000002-step-000000004"]
    assert any(n.startswith(".incomplete-") for n in os.listdir(tmp / "ours_before_after_switch"))  # before_switch
    ref, final = _npz(tmp / "ref.npz"), _npz(tmp / "final.npz")
    _assert_bit_identical(final, ref)  # weights, BatchNorm statistics, optimizer slots and iterations
    assert int(final["opt0"]) == 24
    # The resumed epochs' losses too: the interrupted epoch's running metrics were restored.
    assert np.array_equal(final["loss"], ref["loss"][-len(final["loss"]):]) and len(final["loss"]) == 4
    assert not (tmp / "ours").exists()  # delete_checkpoint=True, as Keras


def test_a_plain_model_resumes_exactly_from_an_epoch_end_backup(killed_runs):
    tmp, statuses, stderr = killed_runs
    assert statuses["plain_after_switch"] == KILL and statuses["plain_final"] == 0, stderr[-3000:]
    assert sorted(os.listdir(tmp / "plain_before_final")) == ["epoch-000002-step-000000000",
                                                              "epoch-000003-step-000000000"]
    final, ref = _npz(tmp / "plain.npz"), _npz(tmp / "plain_ref.npz")
    _assert_bit_identical(final, ref)
    assert np.array_equal(final["loss"], ref["loss"][3:])


def test_negative_control_keras_callback_pairs_new_weights_with_an_old_epoch(killed_runs):
    """Killed between its two files, Keras' backup holds the weights of step 6 and the position of step 3."""
    tmp, statuses, _ = killed_runs
    assert statuses["keras_after_weights"] == KILL and statuses["keras_resumed"] == 0
    snapshot = tmp / "keras_after_kill"
    metadata = json.loads((snapshot / "training_metadata.json").read_text())
    with h5py.File(snapshot / "latest.weights.h5", "r") as f:
        iterations = int(f["optimizer/vars/0"][()])
    assert metadata == {"epoch": 0, "batch": 2} and iterations == 6  # step 6's weights, step 3's position
    resumed, ref = _npz(tmp / "keras.npz"), _npz(tmp / "plain_ref.npz")
    assert int(resumed["opt0"]) == 30 and int(ref["opt0"]) == 24  # it trained 6 steps twice
    assert not np.array_equal(resumed["w0"], ref["w0"])


def test_negative_control_keras_callback_killed_mid_write_cannot_resume(killed_runs):
    """Keras' backup killed inside the weights write: its resume fails with an h5py OSError that names no path.
    keras_lms' callback, given the same directory, says which directory and what to do, in one line."""
    tmp, statuses, _ = killed_runs
    assert statuses["keras_mid_weights"] == KILL
    directory = tmp / "keras_mid"
    model = build(wrapped=False)
    callback = keras.callbacks.BackupAndRestore(str(directory))
    callback.set_model(model)
    with pytest.raises(OSError) as err:
        callback.on_train_begin()
    assert str(directory) not in str(err.value) and "latest.weights.h5" not in str(err.value)
    ours = BackupAndRestore(str(directory))
    ours.set_model(build(wrapped=False))
    with pytest.raises(BackupError) as err:
        ours.on_train_begin()
    _assert_one_line_naming(err.value, directory)


def test_save_weights_killed_mid_write_keeps_the_previous_file(killed_runs):
    tmp, statuses, _ = killed_runs
    assert statuses["save_weights_wrapped"] == KILL and statuses["save_weights_plain"] == KILL
    model = build(wrapped=True)
    expected = model.get_weights()  # what the first, complete save held (the same seeds)
    model.set_weights([w * 0 for w in expected])
    model.load_weights(tmp / "wrapped.weights.h5")
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), expected))
    leftovers = [n for n in os.listdir(tmp) if n.startswith(".wrapped.weights.h5.")]
    assert len(leftovers) == 1  # the killed write's temporary file, which nothing reads
    with pytest.raises(OSError):  # negative control: Keras' save_weights wrote in place
        build(wrapped=False).load_weights(tmp / "plain.weights.h5")


# ----------------------------------------------------------------------------------------- in this process
def _small_model():
    """Dropout with an explicit seed draws from its seed generator on every back end (torch's unseeded Dropout draws
    from torch's global generator, which the killed runs cover)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5, seed=5),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _seed_state(model) -> np.ndarray:
    (dropout,) = [layer for layer in model.layers if isinstance(layer, keras.layers.Dropout)]
    return keras.ops.convert_to_numpy(dropout.seed_generator.state.value)


def _assert_one_line_naming(err, directory):
    message = str(err)
    assert "\n" not in message and str(directory) in message, message
    assert "delete" in message or "Restore" in message, message


def _begin(callback, model):
    callback.set_model(model)
    callback.on_train_begin()
    return callback


def _backups(callback, model, epochs):
    """Write one backup per epoch in `epochs` through the callback's epoch-end hook, changing the weights between;
    returns the directory and the weights each backup holds."""
    model.optimizer.build(model.trainable_variables)
    _begin(callback, model)
    saved = []
    for epoch in epochs:
        model.set_weights([w + 1 for w in model.get_weights()])
        callback.on_epoch_begin(epoch)
        callback.on_epoch_end(epoch)
        saved.append(model.get_weights())
    return callback.directory, saved


@pytest.fixture(scope="module")
def trained_backups(tmp_path_factory):
    """One epoch trained with Keras' and keras_lms' callbacks side by side (a backup at its end)."""
    tmp = tmp_path_factory.mktemp("trained")
    model = _small_model()
    before = _seed_state(model)
    x = np.random.default_rng(0).random((8, 4)).astype("float32")
    model.fit(x, np.zeros((8, 1)), batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp / "keras"), delete_checkpoint=False),
        BackupAndRestore(str(tmp / "ours"), delete_checkpoint=False)])
    return tmp, before, _seed_state(model), model.get_weights()


def test_negative_control_keras_callback_does_not_restore_dropout_seeds(trained_backups):
    tmp, before, after, weights = trained_backups
    assert not np.array_equal(before, after)  # two Dropout masks were drawn
    keras_model = _small_model()
    _begin(keras.callbacks.BackupAndRestore(str(tmp / "keras")), keras_model)
    assert all(np.array_equal(a, b) for a, b in zip(keras_model.get_weights(), weights))
    assert np.array_equal(_seed_state(keras_model), before)  # Keras: the masks start over
    ours = _small_model()
    _begin(BackupAndRestore(str(tmp / "ours")), ours)
    assert all(np.array_equal(a, b) for a, b in zip(ours.get_weights(), weights))
    assert np.array_equal(_seed_state(ours), after)
    assert keras_lms.random_state.seed_state_variables(ours) and keras_model._initial_epoch == 1


def test_a_backup_without_its_weights_is_never_resumed_with_fresh_weights(trained_backups, tmp_path):
    tmp, _, _, weights = trained_backups
    import shutil

    keras_dir, ours_dir = tmp_path / "keras", tmp_path / "ours"
    shutil.copytree(tmp / "keras", keras_dir)
    shutil.copytree(tmp / "ours", ours_dir)
    (keras_dir / "latest.weights.h5").unlink()
    model = _small_model()
    fresh = model.get_weights()
    _begin(keras.callbacks.BackupAndRestore(str(keras_dir)), model)  # negative control: silently fresh weights
    assert model._initial_epoch == 1 and all(np.array_equal(a, b) for a, b in zip(model.get_weights(), fresh))
    (backup,) = [p for p in ours_dir.iterdir() if p.name.startswith("epoch-")]
    (backup / WEIGHTS).unlink()
    with pytest.raises(BackupError) as err:
        _begin(BackupAndRestore(str(ours_dir)), _small_model())
    _assert_one_line_naming(err.value, ours_dir)
    assert f"{WEIGHTS} is missing" in str(err.value)


def test_a_keras_callback_backup_is_resumed_as_keras_would_with_a_warning(trained_backups):
    tmp, _, _, weights = trained_backups
    model = _small_model()
    with pytest.warns(UserWarning, match="keras.callbacks.BackupAndRestore.*not exact"):
        _begin(BackupAndRestore(str(tmp / "keras")), model)
    assert model._initial_epoch == 1 and all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))


def test_a_damaged_newest_backup_falls_back_to_the_previous_one(tmp_path):
    model = _small_model()
    directory, saved = _backups(BackupAndRestore(str(tmp_path), double_checkpoint=True), model, epochs=[0, 1, 2])
    names = sorted(os.listdir(directory))
    assert names == ["epoch-000002-step-000000000", "epoch-000003-step-000000000"]  # double_checkpoint keeps 2
    previous_weights = saved[1]
    weights_file = pathlib.Path(directory, names[1], WEIGHTS)
    raw = bytearray(weights_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: same size, another checksum
    weights_file.write_bytes(bytes(raw))
    restored = _small_model()
    with pytest.warns(UserWarning, match=f"{names[1]}: {WEIGHTS} does not match.*previous good one"):
        _begin(BackupAndRestore(str(tmp_path), double_checkpoint=True), restored)
    assert restored._initial_epoch == 2
    assert all(np.array_equal(a, b) for a, b in zip(restored.get_weights(), previous_weights))
    assert sorted(os.listdir(directory)) == names[:1]  # the damaged one is gone


def test_when_every_backup_is_damaged_one_line_names_the_directory(tmp_path):
    directory, _ = _backups(BackupAndRestore(str(tmp_path), double_checkpoint=True), _small_model(), epochs=[0, 1])
    newest, previous = sorted(pathlib.Path(directory).iterdir(), reverse=True)
    with open(newest / STATE, "ab") as fh:
        fh.write(b"x")  # appended to
    (previous / backup_store.MANIFEST).write_text("{")  # cut short
    with pytest.raises(BackupError) as err:
        _begin(BackupAndRestore(str(tmp_path)), _small_model())
    _assert_one_line_naming(err.value, tmp_path)
    assert f"{STATE} has" in str(err.value) and "MANIFEST.json is unreadable" in str(err.value)


def test_leftovers_of_killed_writes_are_ignored_and_removed(tmp_path):
    (tmp_path / ".incomplete-epoch-000001-step-000000000-1").mkdir(parents=True)
    (tmp_path / ".stale-epoch-000000-step-000000001-1").mkdir()
    directory, _ = _backups(BackupAndRestore(str(tmp_path)), _small_model(), epochs=[0])
    assert os.listdir(directory) == ["epoch-000001-step-000000000"]
    (tmp_path / "epoch-000009-step-000000009").mkdir()  # a final name without a manifest: damaged
    with pytest.warns(UserWarning, match="epoch-000009-step-000000009: MANIFEST.json is missing"):
        _begin(BackupAndRestore(str(tmp_path)), _small_model())
    assert os.listdir(tmp_path) == ["epoch-000001-step-000000000"]


def test_a_backup_of_another_model_is_refused_in_one_line(tmp_path):
    _backups(BackupAndRestore(str(tmp_path)), _small_model(), epochs=[0])
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    other.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="does not fit model") as err:
        _begin(BackupAndRestore(str(tmp_path)), other)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


class _FakeHorovod(types.ModuleType):
    """A `horovod.tensorflow` that says rank 1 of 2; the other rank's allgather entry is `peer`."""

    def __init__(self, peer):
        super().__init__("horovod.tensorflow")
        self.peer = peer

    def is_initialized(self):
        return True

    def size(self):
        return 2

    def rank(self):
        return 1

    def allgather_object(self, obj, name=None):
        return [self.peer, obj]


def test_horovod_ranks_use_their_own_directory_and_agree_on_a_backup(tmp_path, monkeypatch):
    assert keras_lms.backup._horovod() is None  # not imported here, or initialised with one rank
    backup_dir = tmp_path / "backups"
    hvd = _FakeHorovod(peer=([], False))
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", hvd)
    model = _small_model()
    callback = BackupAndRestore(str(backup_dir))
    assert callback.directory == os.path.join(str(backup_dir), "rank-1")
    _, saved = _backups(callback, model, epochs=[0, 1])
    assert sorted(os.listdir(backup_dir / "rank-1")) == ["epoch-000001-step-000000000",
                                                         "epoch-000002-step-000000000"]  # keeps the previous one
    older_weights = saved[0]
    hvd.peer = (["epoch-000001-step-000000000"], True)  # rank 0 was killed before its newer backup was complete
    restored = _small_model()
    with pytest.warns(UserWarning, match="epoch-000002-step-000000000: not written by every rank"):
        _begin(BackupAndRestore(str(backup_dir)), restored)
    assert restored._initial_epoch == 1
    assert all(np.array_equal(a, b) for a, b in zip(restored.get_weights(), older_weights))
    assert os.listdir(backup_dir / "rank-1") == ["epoch-000001-step-000000000"]
    hvd.peer = ([], False)  # a rank without backups: no rank may start from scratch alone
    with pytest.raises(BackupError, match="no usable backup in common") as err:
        _begin(BackupAndRestore(str(backup_dir)), _small_model())
    _assert_one_line_naming(err.value, backup_dir / "rank-1")
    callback.on_train_end()  # delete_checkpoint: this rank's directory, then backup_dir once it is empty
    assert not backup_dir.exists()


def test_horovod_is_not_imported_to_find_the_rank(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    assert BackupAndRestore(str(tmp_path)).directory == str(tmp_path)
    assert "horovod" not in sys.modules and "horovod.tensorflow" not in sys.modules


@pytest.mark.parametrize("kwargs, error", [
    (dict(backup_dir=""), ValueError), (dict(backup_dir=None), ValueError),
    (dict(backup_dir="d", save_freq=0), ValueError), (dict(backup_dir="d", save_freq="batch"), ValueError),
    (dict(backup_dir="d", save_freq=True), ValueError), (dict(backup_dir="d", double_checkpoint="yes"), TypeError),
    (dict(backup_dir="d", delete_checkpoint=None), TypeError),
])
def test_arguments_are_checked_in_the_constructor(kwargs, error):
    with pytest.raises(error, match=next(iter(k for k in kwargs if k != "backup_dir"), "backup_dir")):
        BackupAndRestore(**kwargs)


def test_save_weights_interrupted_mid_write_keeps_the_previous_file(tmp_path, monkeypatch):
    model = keras_lms.wrap(build(wrapped=False), min_bytes=0)
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    first = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(h5py.Group, "__setitem__", broken)
    with pytest.raises(OSError, match="disk full"):
        model.save_weights(path)
    assert path.read_bytes() == first and os.listdir(tmp_path) == ["m.weights.h5"]
    monkeypatch.undo()
    model.save_weights(str(path))  # a str path too; same layout as the plain model's file
    fresh = build(wrapped=False)
    fresh.load_weights(path)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), model.get_weights()))


def test_the_data_helper_is_deterministic():
    x1, _ = data()
    x2, _ = data()
    assert np.array_equal(x1, x2)
