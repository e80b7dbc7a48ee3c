"""Wrapped vs plain training-step time on CPU, measured side by side in one run.

    python -m benchmarks.cpu_overhead [--steps 15] [--repeats 3]      # from the repository root
    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python -m benchmarks.cpu_overhead      # the JAX back end

On TensorFlow the step is a ``tf.function`` (no XLA); on JAX a jitted stateless step (``stateless_call``,
``jax.value_and_grad``, ``optimizer.stateless_apply``, state donated), as Keras' JAX trainer runs it.

Prints the median step time of each and the ratio wrapped/plain for a 2D U-Net (8x256x256x1) and a
ResNet-style model. Plain and wrapped steps alternate step by step so machine noise hits both equally;
every layer input is offloaded (min_bytes=0, keep_last=1), the worst case for overhead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from rich.console import Console
from rich.table import Table

import keras_lms

try:
    from benchmarks.models import build_unet, resnetish
except ModuleNotFoundError as err:  # run as a file: the repository root is not on sys.path
    if err.name != "benchmarks":
        raise
    raise SystemExit("run it from the repository root as a module: python -m benchmarks.cpu_overhead ...") from err


def make_step(model, optimizer, x, y):
    """A callable running one training step of ``model`` and returning its loss."""
    if keras.backend.backend() == "jax":
        return make_jax_step(model, optimizer, x, y)
    import tensorflow as tf

    x, y = tf.constant(x), tf.constant(y)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def make_jax_step(model, optimizer, x, y):
    import jax

    loss_fn = keras.losses.MeanSquaredError()
    optimizer.build(model.trainable_variables)

    def step(trainable, non_trainable, optimizer_vars):
        def loss_of(trainable, non_trainable):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            return loss_fn(y, y_pred), non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable, non_trainable)
        trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        return loss, (trainable, non_trainable, optimizer_vars)

    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    state = [tuple(jax.numpy.array(v.value) for v in variables)
             for variables in (model.trainable_variables, model.non_trainable_variables, optimizer.variables)]

    def run():
        loss, new_state = jitted(*state)
        state[:] = new_state
        return loss

    return run


def measure(name, model, x, y, steps, repeats, wrap_kwargs):
    wrapped = keras_lms.wrap(model, **wrap_kwargs)
    runners = {
        "plain": make_step(model, keras.optimizers.SGD(1e-3), x, y),
        "wrapped": make_step(wrapped, keras.optimizers.SGD(1e-3), x, y),
    }
    for run in runners.values():  # trace + warm up
        run()
        run()
    times = {k: [] for k in runners}
    for _ in range(repeats * steps):  # alternate step by step so drift and noise hit both variants alike
        for key, run in runners.items():
            start = time.perf_counter()
            keras.ops.convert_to_numpy(run())
            times[key].append(time.perf_counter() - start)
    plain, lms = statistics.median(times["plain"]), statistics.median(times["wrapped"])
    offloaded = wrapped.offloaded_bytes_per_step
    return dict(model=name, batch=f"{tuple(x.shape)}", plain_ms=plain * 1e3, wrapped_ms=lms * 1e3,
                ratio=lms / plain, offloaded_mib=offloaded / 2**20)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="steps per round and variant")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    size = 64 if args.small else 256
    unet = build_unet((size, size, 1), depth=3, base_filters=16)
    xu = rng.random((8, size, size, 1), dtype="float32")
    yu = (rng.random((8, size, size, 1)) > 0.5).astype("float32")
    rsize = 32 if args.small else 128
    res = resnetish(rsize)
    xr = rng.random((8, rsize, rsize, 3), dtype="float32")
    yr = rng.random((8, 10), dtype="float32")
    rows = [
        measure("2D U-Net", unet, xu, yu, args.steps, args.repeats, dict(min_bytes=0)),
        measure("ResNet-ish", res, xr, yr, args.steps, args.repeats, dict(min_bytes=0)),
    ]
    table = Table(title=f"keras-lms CPU overhead on {keras.backend.backend()} (median step time, wrapped vs plain)")
    for col in ("model", "batch", "plain ms", "wrapped ms", "ratio", "offloaded MiB/step"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], r["batch"], f"{r['plain_ms']:.1f}", f"{r['wrapped_ms']:.1f}", f"{r['ratio']:.3f}",
                      f"{r['offloaded_mib']:.1f}")
    Console().print(table)
    return rows


if __name__ == "__main__":
    main()
