"""How well does the static report predict a real step's memory? Measured on the CPU allocator.

    python -m benchmarks.report_accuracy          # from the repository root

For each model: the report's predicted device peak of a plain training step (weights + gradients + optimizer
state + activations) vs the peak of TensorFlow's CPU allocator (``get_memory_info('CPU:0')``) measured over
one compiled training step (reset right before it). Prints both and the relative error.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from rich.console import Console
from rich.table import Table

import keras_lms

try:
    from benchmarks.cpu_overhead import make_step
    from benchmarks.models import build_unet, resnetish
except ModuleNotFoundError as err:  # run as a file: the repository root is not on sys.path
    if err.name != "benchmarks":
        raise
    raise SystemExit("run it from the repository root as a module: python -m benchmarks.report_accuracy ...") from err


def measured_peak(model, x, y):
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    step = make_step(model, opt, x, y)
    step()  # trace and allocate once
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step().numpy()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return peak, before, opt


def main():
    rng = np.random.default_rng(0)
    cases = [
        ("2D U-Net 256x256", build_unet((256, 256, 1), depth=3, base_filters=16), (256, 256, 1), 8),
        ("3D U-Net 64^3", build_unet((64, 64, 64, 1), depth=3, base_filters=8), (64, 64, 64, 1), 2),
        ("ResNet-ish 128x128", resnetish(128), (128, 128, 3), 8),
    ]
    table = Table(title="static report vs measured CPU allocator peak (plain training step)")
    for col in ("model", "batch", "predicted MiB", "measured MiB", "rel. error"):
        table.add_column(col)
    for name, model, shape, batch in cases:
        x = tf.constant(rng.random((batch, *shape), dtype="float32"))
        y = model(x, training=False)
        y = tf.constant(rng.random(y.shape, dtype="float32"))
        peak, _, opt = measured_peak(model, x, y)
        model.optimizer = None
        predicted = keras_lms.report(model, batch_size=batch).totals["predicted_peak_bytes_plain"]
        # The measured peak also holds the batch and targets (inputs of the step, not activations).
        measured = peak
        table.add_row(name, str(batch), f"{predicted / 2**20:.1f}", f"{measured / 2**20:.1f}",
                      f"{(predicted - measured) / measured:+.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()
