"""Training runs that die by SIGKILL at a chosen point of a backup write, for tests/test_backup.py.

    python -m tests.backup_runs plan.json     # from the repository root

`plan.json` holds {"lanes": [[run, ...], ...], "results": path}. Every run is a fresh process that trains a small
model (Dense, BatchNormalization, Dropout; optionally `keras_lms.wrap`-ped) with a backup callback and may kill
itself with SIGKILL (`os.kill(os.getpid(), SIGKILL)`: no Python cleanup, no flush beyond what was already
written) at the point its `kill` names, during its `kill_at`-th backup:

* `mid_weights`: after `kill_after` variables of the weights file are written (Keras' H5 store, used by both
  callbacks and by `save_weights`);
* `after_weights`: right after the weights file is closed (keras_lms: before state.npz and the manifest;
  Keras: before training_metadata.json);
* `before_switch` / `after_switch`: keras_lms only, just before / after the rename that switches a backup in.

Why one process forks the runs: importing Keras (and TensorFlow, which Keras imports on every back end) takes 10-20
s on a loaded 2-core CI machine; this process imports once, before any TensorFlow or torch computation has run, and
`fork`s a child per run, which starts the runtime afresh (a forked child is as new to the files on disk as a new
command would be). The runs of one lane depend on each other (they share a backup directory) and run in order;
lanes run side by side. The results file maps each run's `name` to its exit status. tests/test_backup.py imports
`build` and `data` from here too, and starts this script with one thread per runtime (two lanes on two cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys

import keras
import numpy as np
from keras.src.saving import saving_lib  # the runs hook Keras' H5 store to die mid-write

import keras_lms
from keras_lms import backup, backup_store

BATCH, SAMPLES, FEATURES = 4, 16, 8  # 4 batches per epoch
if importlib.util.find_spec("tensorflow") is not None:
    import tensorflow  # noqa: F401 - set_random_seed imports it on every back end: once here, not once per run


def build(wrapped: bool):
    """The model every run builds, from the same seeds (as a rerun of the same command would)."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Dropout(0.5)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    if wrapped:
        model = keras_lms.wrap(model, min_bytes=0)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.random((SAMPLES, FEATURES)).astype("float32"), rng.random((SAMPLES, 1)).astype("float32")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str | None, at: int, after: int) -> None:
    """Die at `point` during the `at`-th weights file this process writes (see the module docstring)."""
    if point is None:
        return
    count = {"files": 0, "variables": 0}
    original_init, original_set, original_close = (saving_lib.H5IOStore.__init__, saving_lib.H5IOStore.__setitem__,
                                                   saving_lib.H5IOStore.close)

    def init(self, path_or_io, archive=None, mode="r"):
        original_init(self, path_or_io, archive=archive, mode=mode)
        if mode == "w":
            count["files"] += 1
            count["variables"] = 0

    def setitem(self, key, value):
        original_set(self, key, value)
        count["variables"] += 1
        if point == "mid_weights" and count["files"] == at and count["variables"] == after:
            die()

    def close(self):
        original_close(self)
        if point == "after_weights" and self.mode == "w" and count["files"] == at:
            die()

    saving_lib.H5IOStore.__init__, saving_lib.H5IOStore.__setitem__ = init, setitem
    saving_lib.H5IOStore.close = close
    if point in ("before_switch", "after_switch"):
        switch, switches = backup_store._switch, [0]

        def dying_switch(tmp, final):
            switches[0] += 1
            if switches[0] == at and point == "before_switch":
                die()
            switch(tmp, final)
            if switches[0] == at and point == "after_switch":
                die()

        backup_store._switch = dying_switch


def train(run: dict) -> None:
    install_kill(run.get("kill"), run.get("kill_at", 2), run.get("kill_after", 5))
    x, y = data()
    if run.get("save_weights"):  # a weights file saved, changed, saved again (killed mid-write)
        model = build(run.get("wrapped", True))
        model.save_weights(run["save_weights"])
        model.set_weights([w + 1 for w in model.get_weights()])
        model.save_weights(run["save_weights"])
        return
    model = build(run.get("wrapped", True))
    callbacks = []
    save_freq = run.get("save_freq", 3)
    if run.get("callback") == "keras_lms":
        callbacks.append(backup.BackupAndRestore(run["dir"], save_freq=save_freq))
    elif run.get("callback") == "keras":
        callbacks.append(keras.callbacks.BackupAndRestore(run["dir"], save_freq=save_freq))
    history = model.fit(x, y, batch_size=BATCH, epochs=run.get("epochs", 6), shuffle=False, verbose=0,
                        callbacks=callbacks)
    if run.get("out"):
        arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({f"opt{i}": keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.optimizer.variables)})
        arrays["loss"] = np.asarray(history.history["loss"])
        np.savez(run["out"], **arrays)


def child(run: dict) -> int:
    """Run `run` in a forked process; its exit status (negative: the signal that killed it)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
            train(run)
        except BaseException as err:  # noqa: B036 - report anything, then leave without the parent's cleanup
            print(f"run {run['name']}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def lane(runs: list, results: str) -> None:
    statuses = {}
    for run in runs:
        if run.get("snapshot"):  # keep a copy of the directory as the previous run left it
            shutil.copytree(run["dir"], run["snapshot"])
        statuses[run["name"]] = child(run)
    with open(results, "w") as fh:
        json.dump(statuses, fh)


def main(plan_path: str) -> int:
    with open(plan_path) as fh:
        plan = json.load(fh)
    pids = []
    for i, runs in enumerate(plan["lanes"]):
        pid = os.fork()
        if pid == 0:
            try:
                lane(runs, f"{plan['results']}.{i}")
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    statuses = {}
    for i in range(len(plan["lanes"])):
        with open(f"{plan['results']}.{i}") as fh:
            statuses.update(json.load(fh))
    with open(plan["results"], "w") as fh:
        json.dump(statuses, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
