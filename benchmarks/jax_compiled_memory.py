"""Device and host memory of one Keras training step on the JAX back end, compiled for an H100 without one.

    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python benchmarks/jax_compiled_memory.py            # the three U-Nets, ~4 min
    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python benchmarks/jax_compiled_memory.py --quick    # a small U-Net
    ... --variants plain,host_residuals --models 3d48 --json out.json
    ... --variants plain,host_residuals --device-memory-mib 250    # XLA assumes 250 MiB of device memory
    ... --max-cube --variants plain,host_residuals [--dtype-policy mixed_float16]   # largest cube at 16 GiB, ~2 min

Needs the jax CUDA plugin (``pip install "jax[cuda12]"``), no GPU: each step (forward, MSE loss, gradients,
Adam update; Keras' ``compute_loss_and_updates`` and ``optimizer.stateless_apply``, state donated as ``fit``
does) is lowered and compiled by XLA's GPU pipeline for the H100 of ``keras_lms/offload/jax/h100_target_config.txtpb``
(`keras_lms.offload.jax.deviceless`). Per model and variant it prints the compiled program's device temporaries,
arguments and host (``S(5)``) temporaries, the asynchronous copies to and from host memory in its HLO, the bytes
the variant meant to keep on host, and device temp relative to the plain step.

Variants (each layer's call but the input and Concatenate is intercepted; ``docs/jax_findings.md``):

- ``plain``: the Keras step as ``fit`` runs it.
- ``naive``: each layer under ``jax.checkpoint`` with ``save_and_offload_only_these_names``, its inputs named
  for offload (`host_residuals.checkpoint_offload_call`): the negative control.
- ``whole``: one ``jax.checkpoint`` with the offload policy around the whole forward, each layer's output named.
- ``host_residuals``: `host_residuals.host_residual_call` (custom_vjp, pullback residuals on host, ordered by
  optimisation barriers).
- ``wrap``: the product's one line, ``keras_lms.wrap(model, min_bytes=..., keep_last=0)`` under Keras' JAX
  trainer (the same mechanism, as the plan decides it); its row also gives the plan's host bytes and the peaks
  ``keras_lms.report`` predicts (plain and wrapped), set beside the compiled program's device temp + arguments.
- ``host_residuals-<part>[-<part>]``: an ablation, without the ``forward``/``backward``/``gradients`` barrier,
  the ``lean`` transposed-convolution backward or the recomputed ``constants``.
- ``<variant>+lhs``: the same compiled with XLA's latency-hiding scheduler and a 16 GiB memory limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.models, run as a script

import jax
import keras
import numpy as np
from rich.console import Console
from rich.table import Table

import keras_lms
from benchmarks.models import unet
from keras_lms import _keras_adapter as adapter
from keras_lms import planning
from keras_lms._keras_adapter.calls import patched_calls  # the whole-forward variant
from keras_lms.offload.jax import deviceless, host_residuals

MIB = float(1 << 20)
HOST_RAM = 1 << 40  # the simulated GPU server's host memory (--max-cube), as benchmarks/simulated_gpu_peak.py
LHS_OPTIONS = {  # XLA's memory-aware scheduling: the latency-hiding scheduler under a tighter memory limit
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_memory_limit_slop_factor": 50,
    "xla_gpu_enable_pipelined_host_offloading": True,
}
MODELS = {
    "2d256": ("2D U-Net 8x256x256x1", lambda: unet((256, 256, 1), 32), 8),
    "3d48": ("3D U-Net 2x48^3x1", lambda: unet((48, 48, 48, 1), 16), 2),
    "3d96": ("3D U-Net 2x96^3x1", lambda: unet((96, 96, 96, 1), 16), 2),
    "quick": ("2D U-Net 2x64x64x1 (2 levels, 8 filters)", lambda: unet((64, 64, 1), 8, levels=2), 2),
}
VARIANTS = ("plain", "naive", "whole", "host_residuals")


def prepared(build, batch, wrap_min_bytes=None):
    """A compiled (Adam, MSE) model with its optimizer and metrics built, and its batch's (x, y) shapes
    (``wrap_min_bytes``: the model ``keras_lms.wrap``ped with that threshold and ``keep_last=0``)."""
    keras.utils.set_random_seed(0)
    model = build()
    x = np.zeros((batch, *model.input_shape[1:]), "float32")
    y = np.zeros((batch, *model.output_shape[1:]), "float32")
    if wrap_min_bytes is not None:
        model = keras_lms.wrap(model, min_bytes=wrap_min_bytes, keep_last=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    adapter.build_compiled_metrics(model, (x, y))
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return model, x, y


def intercepted_layers(model, with_concatenate=False):
    """The layers whose calls an offload variant intercepts: all but inputs and (unless ``with_concatenate``)
    Concatenate, which keeps no residuals (host_residuals intercepts it to split its gradient at once)."""
    skip = (keras.layers.InputLayer,) if with_concatenate else (keras.layers.InputLayer, keras.layers.Concatenate)
    return [layer for layer in model.layers if not isinstance(layer, skip)]


@contextlib.contextmanager
def variant_patches(model, variant, min_bytes, record):
    """Install the variant's stand-in calls for the duration of tracing."""
    layers = intercepted_layers(model, with_concatenate=variant.startswith("host_residuals"))
    if variant in ("plain", "wrap"):
        yield
    elif variant == "naive":
        with host_residuals.checkpoint_offloading(layers, min_bytes):
            yield
    elif variant == "host_residuals":
        with host_residuals.host_residuals(layers, min_bytes, record):
            yield
    elif variant.startswith("host_residuals-"):  # an ablation: host_residuals-<part>[-<part>...]
        parts = set(variant.split("-")[1:])
        with host_residuals.host_residuals(layers, min_bytes, record, barriers=host_residuals.BARRIERS - parts,
                                           lean="lean" not in parts, recompute_constants="constants" not in parts):
            yield
    elif variant == "whole":
        def name_output(op, original):
            def call(*args, **kwargs):
                out = original(*args, **kwargs)
                if host_residuals._nbytes(out) >= min_bytes:
                    record.append((op.name, host_residuals._nbytes(out)))
                    return jax.ad_checkpoint.checkpoint_name(out, host_residuals.OFFLOAD_NAME)
                return out
            return call

        def whole_forward(op, original):
            def call(*args, **kwargs):
                fn, trainable, non_trainable, arrays, assign_back = host_residuals.stateless_pure_call(
                    op, original, args, kwargs)
                out, new = jax.checkpoint(fn, policy=host_residuals.offload_policy())(trainable, non_trainable,
                                                                                      arrays)
                assign_back(new)
                return out
            return call

        with patched_calls([model], whole_forward), patched_calls(layers, name_output):
            yield
    else:
        raise ValueError(f"unknown variant {variant!r}")


def measure(key, variant, min_bytes, console=None, extra_options=None, device_memory=None):
    """Compile one model's step under one variant; a dict of the figures (bytes)."""
    label, build, batch = MODELS[key]
    base, _, flags = variant.partition("+")
    model, x, y = prepared(build, batch, wrap_min_bytes=min_bytes if base == "wrap" else None)
    record = []
    with variant_patches(model, base, min_bytes, record):
        info = deviceless.compile_keras_step(model, x, y, compiler_options={
            **(LHS_OPTIONS if flags == "lhs" else {}), **(extra_options or {})} or None,
            device_memory_size=device_memory)
    row = {"model": label, "variant": variant, "temp": info.temp_bytes, "args": info.argument_bytes,
           "outputs": info.output_bytes, "alias": info.alias_bytes,
           "host_temp": info.host_temp_bytes, "to_host": info.to_host_copies, "to_device": info.to_device_copies,
           "planned_host": sum(b for _, b in record),
           "seconds": info.compile_seconds}
    if base == "wrap":
        predicted = keras_lms.report(model, batch_size=batch).totals
        row.update(planned_host=planning.host_bytes_per_step(model.lms_plan),
                   report_plain=predicted["predicted_peak_bytes_plain"],
                   report_wrapped=predicted["predicted_peak_bytes_wrapped"])
    if console is not None:
        console.log(f"{label} {variant}: temp {row['temp'] / MIB:.1f} MiB, host {row['host_temp'] / MIB:.1f} MiB,"
                    f" copies {row['to_host']}/{row['to_device']}, {row['seconds']:.1f} s")
    return row


def cube_fits(edge, variant, memory, min_bytes, dtype_policy=None, options=None):
    """(fits, device bytes) of the 3D U-Net of docs/benchmarks.md' largest-cube search (depth 4, 16 filters,
    batch 1) at ``edge``^3, compiled for an H100 with ``memory`` bytes: temporaries + arguments + outputs not
    aliased to donated arguments must fit. The host is a GPU server's (``HOST_RAM``), not this machine's: the
    wrapped model's check of the host memory its plan needs would refuse these cubes here."""
    from unittest import mock

    from keras_lms import memory as lms_memory

    if dtype_policy:
        keras.mixed_precision.set_dtype_policy(dtype_policy)
    MODELS["cube"] = (f"3D U-Net 1x{edge}^3x1", lambda: unet((edge, edge, edge, 1), 16), 1)
    with mock.patch.object(lms_memory, "host_available_bytes", lambda: HOST_RAM):
        row = measure("cube", variant, min_bytes, extra_options=options, device_memory=memory)
    used = row["temp"] + row["args"] + row["outputs"] - row["alias"]
    return used <= memory, used


def largest_cube(variant, memory, min_bytes, lo, hi, console, dtype_policy=None, options=None):
    """Binary search over edges (multiples of 16) in [lo, hi]: the largest that fits, with each probe logged."""
    best, lo, hi = None, lo // 16, hi // 16
    while lo <= hi:
        mid = (lo + hi) // 2
        fits, used = cube_fits(16 * mid, variant, memory, min_bytes, dtype_policy, options)
        console.log(f"{variant} {16 * mid}^3: {used / 2**30:.2f} GiB of {memory / 2**30:.0f}, "
                    f"{'fits' if fits else 'does not fit'}")
        if fits:
            best, lo = 16 * mid, mid + 1
        else:
            hi = mid - 1
    return best


def table(rows) -> Table:
    out = Table(title="One training step compiled for an H100 (deviceless), MiB")
    for column in ("model", "variant", "device temp", "args", "host temp", "planned host", "S(5) out/in",
                   "temp / plain", "compile s"):
        out.add_column(column, justify="left" if column in ("model", "variant") else "right")
    plain = {r["model"]: r["temp"] for r in rows if r["variant"] == "plain"}
    for r in rows:
        ratio = f"{r['temp'] / plain[r['model']]:.2f}" if plain.get(r["model"]) else "-"
        out.add_row(r["model"], r["variant"], f"{r['temp'] / MIB:,.1f}", f"{r['args'] / MIB:,.1f}",
                    f"{r['host_temp'] / MIB:,.1f}", f"{r['planned_host'] / MIB:,.1f}",
                    f"{r['to_host']}/{r['to_device']}", ratio, f"{r['seconds']:.1f}")
    return out


def report_table(rows) -> Table:
    """keras_lms.report's predicted device peaks beside the compiled programs' device temp + arguments."""
    out = Table(title="The report's predicted peak vs the compiled program (temp + arguments), MiB")
    for column in ("model", "compiled plain", "report plain", "ratio", "compiled wrapped", "report wrapped",
                   "ratio"):
        out.add_column(column, justify="left" if column == "model" else "right")
    plain = {r["model"]: r for r in rows if r["variant"] == "plain"}
    for r in rows:
        if r["variant"] != "wrap":
            continue
        compiled_wrapped = r["temp"] + r["args"]
        p = plain.get(r["model"])
        compiled_plain = p["temp"] + p["args"] if p else None
        out.add_row(r["model"], f"{compiled_plain / MIB:,.1f}" if p else "-", f"{r['report_plain'] / MIB:,.1f}",
                    f"{r['report_plain'] / compiled_plain:.2f}" if p else "-", f"{compiled_wrapped / MIB:,.1f}",
                    f"{r['report_wrapped'] / MIB:,.1f}", f"{r['report_wrapped'] / compiled_wrapped:.2f}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="2d256,3d48,3d96", help=f"comma-separated keys of {sorted(MODELS)}")
    parser.add_argument("--quick", action="store_true", help="only the small U-Net")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated; append +lhs for the latency-hiding scheduler with a memory limit")
    parser.add_argument("--min-bytes", type=int, default=host_residuals.DEFAULT_MIN_BYTES,
                        help="smallest tensor offloaded (bytes)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--xla-options", default="{}", help="JSON of XLA compiler options for every compile")
    parser.add_argument("--device-memory-mib", type=int,
                        help="device memory the compiler assumes (default the H100's 80 GB; XLA's scheduler limit)")
    parser.add_argument("--max-cube", action="store_true",
                        help="largest 3D U-Net cube (depth 4, 16 filters, batch 1) per variant at --cube-gib")
    parser.add_argument("--cube-gib", type=float, default=16.0)
    parser.add_argument("--cube-range", default="128,512", help="edges searched (multiples of 16)")
    parser.add_argument("--dtype-policy", help="e.g. mixed_float16 (the --max-cube models)")
    args = parser.parse_args(argv)
    console = Console(width=160)
    if args.max_cube:
        memory = int(args.cube_gib * 2**30)
        lo, hi = (int(v) for v in args.cube_range.split(","))
        found = {v: largest_cube(v, memory, args.min_bytes, lo, hi, console, args.dtype_policy,
                                 json.loads(args.xla_options))
                 for v in args.variants.split(",")}
        for variant, edge in found.items():
            console.print(f"{variant}: largest cube {edge}^3 at {args.cube_gib:g} GiB"
                          + (f" ({(edge / found['plain']) ** 3:.2f}x plain's voxels)"
                             if found.get("plain") and edge else ""))
        return 0
    keys = ["quick"] if args.quick else args.models.split(",")
    options = json.loads(args.xla_options)
    memory = args.device_memory_mib << 20 if args.device_memory_mib else None
    rows = [measure(key, variant, args.min_bytes, console, options, memory)
            for key in keys for variant in args.variants.split(",")]
    console.print(table(rows))
    if any(r["variant"] == "wrap" for r in rows):
        console.print(report_table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
