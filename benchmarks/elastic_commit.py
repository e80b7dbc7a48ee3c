"""What an elastic commit costs: `hvd.elastic.KerasState.commit()` against one training step, side by side.

    python -m benchmarks.elastic_commit                        # the 3D example's U-Net: 96^3, depth 3, 16 filters
    python -m benchmarks.elastic_commit --volume 64 --batch-size 1 --repeats 3

One process (Horovod of size 1; a commit's host-update check is then a local broadcast). The model is
examples/unet.py's U-Net, wrapped with `keras_lms.wrap` defaults, compiled with keras_lms.horovod's
DistributedOptimizer(Adam) as `examples/segmentation_3d.py --elastic` does. Printed: the committed bytes
(weights, BatchNorm statistics, seed states, Adam slots), the median seconds of a commit and of a training step,
and their ratio: what `--commit-every N` trades (a commit every batch costs ratio x the step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_lms
import keras_lms.horovod as hvd
from examples.unet import build_unet


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--volume", type=int, default=96)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--base-filters", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    hvd.init()
    shape = (args.volume,) * 3 + (1,)
    model = keras_lms.wrap(build_unet(shape, depth=args.depth, base_filters=args.base_filters))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="binary_crossentropy",
                  jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size,) + shape).astype("float32")
    y = (rng.random((args.batch_size,) + shape) > 0.5).astype("float32")
    model.train_on_batch(x, y)  # builds the optimizer, traces the step
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    committed = sum(v.size * v.dtype.itemsize for v in state._saved_values)
    step = median_seconds(lambda: model.train_on_batch(x, y), args.repeats)
    commit = median_seconds(state.commit, args.repeats)
    restore = median_seconds(state.restore, args.repeats)
    print(f"U-Net {args.volume}^3 depth {args.depth}, {args.base_filters} filters, batch {args.batch_size}: "
          f"{len(state._saved_values)} variables, {committed / 2**20:.1f} MiB per commit")
    print(f"| commit | restore | training step | commit / step |\n|---|---|---|---|\n"
          f"| {commit * 1e3:.1f} ms | {restore * 1e3:.1f} ms | {step * 1e3:.0f} ms | {commit / step:.4f} |")


if __name__ == "__main__":
    main()
