"""Time of one backup: keras.callbacks.BackupAndRestore against keras_lms.callbacks.BackupAndRestore.

    python -m benchmarks.backup_cost [--width 4096] [--saves 3] [--dir .]      # from the repository root

Trains one step of a Dense model (2048-width-width-1, with Dropout, Adam), then times `--saves` epoch-end backups
of each callback into fresh directories under `--dir` (use the disk your runs back up to: the difference is mostly
the flush to disk and the checksum read). Prints each save's seconds and the size of a backup.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_lms


def _size_mib(directory: str) -> float:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory)
               for name in names) / 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(args.width), keras.layers.Dense(args.width),
                              keras.layers.Dropout(0.1), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 2048), "float32"), np.ones((8, 1), "float32"), batch_size=8, verbose=0)
    weights_mib = sum(w.size * w.itemsize for w in model.get_weights()) / 2**20
    print(f"{keras.backend.backend()}: {weights_mib:.0f} MiB of weights")
    for name, make in (("keras.callbacks.BackupAndRestore", keras.callbacks.BackupAndRestore),
                       ("keras_lms.callbacks.BackupAndRestore", keras_lms.callbacks.BackupAndRestore)):
        callback = make(tempfile.mkdtemp(prefix="backup_cost_", dir=args.dir))
        callback.set_model(model)
        callback.on_train_begin()
        seconds = []
        for epoch in range(args.saves):
            start = time.perf_counter()
            callback.on_epoch_end(epoch)
            seconds.append(time.perf_counter() - start)
        size = _size_mib(callback.backup_dir)
        callback.on_train_end()  # deletes the directory
        print(f"{name}: save s {', '.join(f'{s:.2f}' for s in seconds)}; backup {size:.0f} MiB")


if __name__ == "__main__":
    main()
