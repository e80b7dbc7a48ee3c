"""Simulated GPU memory peak of a training step, plain vs ``keras_lms.wrap``, beside ``keras_lms.report``.

    python benchmarks/simulated_gpu_peak.py              # Dense sanity check, 2D/3D U-Nets, ResNet (~1.5 min)
    python benchmarks/simulated_gpu_peak.py --forced     # also wrap(min_bytes=0, keep_last=0)
    python benchmarks/simulated_gpu_peak.py --max-cube   # largest 3D U-Net cube that fits 16 GiB (~10 min)
    python benchmarks/simulated_gpu_peak.py --max-cube --dtype-policy mixed_float16   # the same in mixed precision
    python benchmarks/simulated_gpu_peak.py --quick      # small models, forced offload: a smoke run (~40 s)
    python benchmarks/simulated_gpu_peak.py --cube-edges 448 --device-profile h100-pcie5 --device-budget 16GiB \
        --dtype-policy mixed_float16                     # one edge: simulated peak beside the report's (~1 min)
    python benchmarks/simulated_gpu_peak.py --like-for-like --plain-edges 240,256,272 --wrapped-edges 384,400
                                                         # grappler sees 16 GiB and swaps by itself, plain and
                                                         # wrapped; fits k/n over --repeat runs (~1 min per
                                                         # wrapped 3D run, ~10 s per plain one)

(Times on the 2-core development VM.) No GPU is needed and nothing is executed: each step (forward, loss,
gradients, Adam update) is traced on a stand-in device, optimised by grappler's default pipeline for a
virtual GPU + host CPU, and replayed by TensorFlow's virtual scheduler (``keras_lms/testing/simulated_gpu.py`` says how,
and what the peak includes). That is the graph TensorFlow would execute, so an offload that grappler removes,
or a copy back to the GPU that arrives during the forward pass, shows here as no saving. Per model it prints
the simulated peak plain and wrapped (``wrap`` defaults), their ratio, ``keras_lms.report``'s predicted
peaks and ratio beside them, the relative error report vs simulation, and how many ``lms_swap_out`` /
``lms_swap_in`` nodes survived grappler; a second table shows the host traffic, shape inference and
grappler's own ``GraphMemory`` estimate.

The first table checks the simulation on a model whose answer is known by hand: a chain of Dense layers
returning its gradients (no optimizer), whose plain peak is at the start of the backward pass: the weights,
the input, every layer's output (all kept for the backward) and four batch-sized loss temporaries.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.models, run as a script

from keras_lms.testing import simulated_gpu
from keras_lms.testing.logical_devices import HOST_STAND_IN, STAND_IN, configure_logical_cpus

configure_logical_cpus()  # before TensorFlow initialises: /CPU:0 host, /CPU:1 the GPU stand-in

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import keras_lms  # noqa: E402
from benchmarks.models import unet  # noqa: E402 - the max-cube U-Net, also imported from here
from keras_lms import memory as lms_memory  # noqa: E402

MIB = float(1 << 20)
GIB = float(1 << 30)
GPU_MEMORY = 16 << 30
HOST_RAM = 1 << 40  # the simulated machine's RAM, for keras-lms' host-memory check while tracing
CUBE_STEP = 16  # the 3D U-Net pools four times: edges are multiples of 2**4


# ------------------------------------------------------------------------------------------------ models
def dense_chain(width: int = 1024, depth: int = 6) -> keras.Model:
    """``depth`` x Dense(width, relu): each layer's output is kept for its backward (ReluGrad, MatMul)."""
    inputs = keras.Input((width,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"dense{i}")(x)
    return keras.Model(inputs, x, name=f"dense_chain_{depth}x{width}")


def resnet(input_shape, filters: int = 32, stages: int = 3, blocks: int = 2, classes: int = 10) -> keras.Model:
    """ResNet-style classifier: a stem convolution, ``stages`` of ``blocks`` residual blocks (Conv-BN-ReLU,
    Conv-BN, Add, ReLU), filters doubling and resolution halving between stages, global pooling, Dense."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name="stem")(inputs)
    for stage in range(stages):
        width = filters * 2**stage
        for block in range(blocks):
            stride = 2 if stage and not block else 1
            name = f"s{stage}b{block}"
            shortcut = x
            if stride != 1 or x.shape[-1] != width:
                shortcut = keras.layers.Conv2D(width, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
            y = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_c1")(x)
            y = keras.layers.BatchNormalization(name=f"{name}_bn1")(y)
            y = keras.layers.ReLU(name=f"{name}_relu1")(y)
            y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"{name}_c2")(y)
            y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
            x = keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(classes, name="logits")(x), name="resnet")


@dataclasses.dataclass
class Case:
    """A model to simulate: its label, a builder, and the batch size of the step."""

    label: str
    build: object  # () -> keras.Model, called under the stand-in device
    batch: int


def cases(quick: bool) -> list:
    """The issue's models (2D U-Net 8x256x256x1, 3D U-Net 2x48^3 and 2x96^3, a ResNet), or small ones."""
    if quick:
        return [Case("2D U-Net 2x64x64x1 (2 levels, 8 filters)", lambda: unet((64, 64, 1), 8, levels=2), 2),
                Case("3D U-Net 1x32^3x1 (2 levels, 4 filters)", lambda: unet((32, 32, 32, 1), 4, levels=2), 1),
                Case("ResNet-style 2x64x64x3 (2 blocks)", lambda: resnet((64, 64, 3), 16, stages=2, blocks=1), 2)]
    return [Case("2D U-Net 8x256x256x1", lambda: unet((256, 256, 1), 32), 8),
            Case("3D U-Net 2x48^3x1", lambda: unet((48, 48, 48, 1), 16), 2),
            Case("3D U-Net 2x96^3x1", lambda: unet((96, 96, 96, 1), 16), 2),
            Case("ResNet-style 8x256x256x3", lambda: resnet((256, 256, 3), 32), 8)]


def build(case_build):
    """Models and their variables live on the stand-in device, so the variables end up on the virtual GPU."""
    with tf.device(STAND_IN):
        return case_build()


def shapes(model, batch):
    """(x_shape, y_shape) of one step at ``batch``."""
    return (batch, *model.input_shape[1:]), (batch, *model.output_shape[1:])


# ---------------------------------------------------------------------------------------------- measuring
@contextlib.contextmanager
def simulated_host_ram():
    """keras-lms refuses, while tracing, a plan whose host copies exceed this machine's free RAM. The host
    simulated here is a GPU server, not the machine the script runs on, and nothing is executed."""
    from unittest import mock

    with mock.patch.object(lms_memory, "host_available_bytes", lambda: HOST_RAM):
        yield


def wrap_variants(forced: bool, quick: bool = False, device_profile=None) -> dict:
    """``wrap`` settings per variant: "wrapped" = defaults, "forced" = offload every eligible tensor; with
    ``device_profile`` (``--device-profile``) the time-aware plan on that profile (tensors recomputed).

    ``--quick`` runs only "forced": its small models have no tensor as large as the default ``min_bytes``.
    """
    variants = {}
    extra = {"device_profile": device_profile} if device_profile else {}
    if not quick:
        variants["wrapped"] = dict(host_device=HOST_STAND_IN, **extra)
    if forced or quick:
        variants["forced"] = dict(host_device=HOST_STAND_IN, min_bytes=0, keep_last=0, **extra)
    return variants


def measure(case: Case, variants: dict) -> list:
    """Simulated and reported peaks of one model: plain, and wrapped with each variant's settings."""
    model = build(case.build)
    x_shape, y_shape = shapes(model, case.batch)
    plain = simulated_gpu.simulate(model, x_shape, y_shape)
    rows = []
    for variant, kwargs in variants.items():
        wrapped = keras_lms.wrap(model, **kwargs)
        sim = simulated_gpu.simulate(wrapped, x_shape, y_shape)
        totals = keras_lms.report(wrapped, batch_size=case.batch, input_shape=x_shape[1:]).totals
        rows.append(dict(model=case.label, variant=variant, plain=plain, wrapped=sim,
                         report_plain=totals["predicted_peak_bytes_plain"],
                         report_wrapped=totals["predicted_peak_bytes_wrapped"]))
    return rows


def sanity_check(quick: bool) -> tuple:
    """The Dense chain: simulated plain peak vs the hand-computed one (float32, gradients returned).

    Returns (table, {"expected": bytes, "simulated": bytes, "live_outputs": n, "depth": n}).
    """
    width, depth, batch = (256, 6, 256) if quick else (1024, 6, 1024)
    model = build(lambda: dense_chain(width, depth))
    sim = simulated_gpu.simulate(model, (batch, width), (batch, width), optimizer=None)
    tensor = batch * width * 4
    weights = depth * (width * width + width) * 4
    saved = (depth + 1) * tensor  # the input and every layer's output are read by the backward pass
    loss_temporaries = 4 * tensor  # pred - y, its square, and the two batch-sized gradients of the loss
    expected = weights + saved + loss_temporaries
    live_outputs = sum(1 for _, name in sim.gpu.live if name.split("/")[-1].startswith("Relu"))
    table = Table(title=f"sanity check: {depth} x Dense({width}, relu), batch {batch}, float32, plain step "
                        "returning its gradients")
    table.add_column("")
    table.add_column("MiB", justify="right")
    for label, value in (("weights (static)", weights), (f"saved activations: input + {depth} layer outputs", saved),
                         ("loss temporaries: 4 x batch x width", loss_temporaries),
                         ("predicted by hand", expected), ("simulated peak", sim.peak_bytes)):
        table.add_row(label, f"{value / MIB:.2f}")
    table.add_row("layer outputs live at the simulated peak", f"{live_outputs} of {depth}")
    table.add_row("relative difference", f"{(sim.peak_bytes - expected) / expected:+.2%}")
    return table, dict(expected=expected, simulated=sim.peak_bytes, live_outputs=live_outputs, depth=depth)


def _mib(value) -> str:
    return f"{value / MIB:,.0f}" if value >= 10 * MIB else f"{value / MIB:,.1f}"


def results_table(rows) -> Table:
    table = Table(title="simulated GPU peak of a training step (Adam) vs keras_lms.report (MiB); err: report vs "
                        "simulation; swap-out/in: lms_swap_* nodes, traced -> run")
    for column in ("model", "variant", "sim plain", "sim wrapped", "sim ratio", "report plain", "report wrapped",
                   "report ratio", "err plain", "err wrapped", "swap-out", "swap-in"):
        table.add_column(column, justify="left" if column in ("model", "variant") else "right")
    for r in rows:
        plain, wrapped = r["plain"].peak_bytes, r["wrapped"].peak_bytes
        report_plain, report_wrapped = r["report_plain"], r["report_wrapped"]
        swaps = [f"{r['wrapped'].swap_nodes_traced[m]} -> {r['wrapped'].swap_nodes_optimized[m]}"
                 for m in simulated_gpu.SWAP_MARKERS]
        table.add_row(r["model"], r["variant"], _mib(plain), _mib(wrapped), f"{wrapped / plain:.2f}",
                      _mib(report_plain), _mib(report_wrapped), f"{report_wrapped / report_plain:.2f}",
                      f"{(report_plain - plain) / plain:+.0%}", f"{(report_wrapped - wrapped) / wrapped:+.0%}", *swaps)
    return table


def diagnostics_table(rows) -> Table:
    """What the simulation saw: static bytes, host traffic, shape inference, grappler's own estimate, time."""
    table = Table(title="simulation details (MiB unless noted)")
    for column in ("model", "run", "static", "GPU->host", "host->GPU", "unknown shapes", "nodes traced -> optimised",
                   "grappler GraphMemory peak", "seconds"):
        table.add_column(column, justify="left" if column in ("model", "run") else "right")
    seen = set()
    for r in rows:
        for run, sim in (("plain", r["plain"]), (r["variant"], r["wrapped"])):
            if (r["model"], run) in seen:
                continue
            seen.add((r["model"], run))
            table.add_row(r["model"], run, _mib(sim.static_bytes), _mib(sim.gpu.sent_bytes),
                          _mib(sim.gpu.received_bytes), str(sim.gpu.unknown_shape_tensors),
                          f"{sim.nodes_traced} -> {sim.nodes_optimized}",
                          _mib(sim.static_bytes + sim.graph_memory_peak_bytes), f"{sim.seconds:.1f}")
    return table


# -------------------------------------------------------------------------------------------- --max-cube
def cube_peak(edge: int, batch: int, wrap_kwargs) -> int:
    """Simulated peak of the 3D U-Net (16 filters) at ``edge``^3, plain (``wrap_kwargs`` None) or wrapped."""
    model = build(lambda: unet((edge, edge, edge, 1), 16))
    x_shape, y_shape = shapes(model, batch)
    if wrap_kwargs is not None:
        model = keras_lms.wrap(model, **wrap_kwargs)
    return simulated_gpu.simulate(model, x_shape, y_shape, graph_memory=False).peak_bytes


def cube_peak_beside_report(edge: int, batch: int, wrap_kwargs) -> dict:
    """The wrapped 3D U-Net at ``edge``^3: its simulated peak, ``keras_lms.report``'s prediction of it and the
    largest tensors live at the simulated peak (where in the step it is)."""
    model = build(lambda: unet((edge, edge, edge, 1), 16))
    x_shape, y_shape = shapes(model, batch)
    wrapped = keras_lms.wrap(model, **wrap_kwargs)
    sim = simulated_gpu.simulate(wrapped, x_shape, y_shape, graph_memory=False)
    report = keras_lms.report(wrapped, batch_size=batch).totals["predicted_peak_bytes_wrapped"]
    return dict(peak=sim.peak_bytes, report=report, live=[[size, name] for size, name in sim.gpu.live[:4]])


def largest_cube(batch: int, wrap_kwargs, log, start: int = 64) -> tuple:
    """Largest edge (multiple of CUBE_STEP) whose simulated peak fits GPU_MEMORY: grow x1.5, then bisect.

    The peak grows monotonically with the edge, so bisection is sound; ~8-9 simulations per run.

    Returns (edge, {edge: peak bytes} of every edge tried); edge 0 when not even ``start`` bisected down fits.
    """
    peaks = {}

    def fits(edge):
        peaks[edge] = cube_peak(edge, batch, wrap_kwargs)
        log(f"  edge {edge}: {peaks[edge] / GIB:.2f} GiB {'fits' if peaks[edge] <= GPU_MEMORY else 'does not fit'}")
        return peaks[edge] <= GPU_MEMORY

    low, high, edge = 0, None, start  # low fits (0: nothing known to fit), high does not
    while high is None:
        if fits(edge):
            low, edge = edge, max(edge + CUBE_STEP, int(edge * 1.5) // CUBE_STEP * CUBE_STEP)
        else:
            high = edge
    while high - low > CUBE_STEP:
        mid = max(low + CUBE_STEP, (low + high) // 2 // CUBE_STEP * CUBE_STEP)
        if fits(mid):
            low = mid
        else:
            high = mid
    return low, peaks


def max_cube(batch: int, forced: bool, log, runs=None, start: int = 64, device_profile=None) -> list:
    """Largest cube per run (plain, wrapped[, forced]; ``runs`` selects some) as dicts: run, edge, peak bytes,
    voxels. ``start`` is the first edge tried (a multiple of CUBE_STEP)."""
    rows = []
    for run, kwargs in {"plain": None, **wrap_variants(forced, device_profile=device_profile)}.items():
        if runs and run not in runs:
            continue
        log(f"{run}:")
        edge, peaks = largest_cube(batch, kwargs, log, start)
        rows.append(dict(run=run, edge=edge, peak_bytes=peaks.get(edge, 0), voxels=edge**3, tried=peaks))
    return rows


def max_cube_table(rows, batch: int) -> Table:
    table = Table(title=f"largest 3D U-Net (16 filters) cube that fits a {GPU_MEMORY / GIB:.0f} GiB simulated GPU, "
                        f"batch {batch}, edges in steps of {CUBE_STEP}, dtype policy "
                        f"{keras.mixed_precision.global_policy().name}")
    for column in ("run", "largest edge", "simulated peak GiB", "voxels", "voxel ratio vs plain"):
        table.add_column(column, justify="left" if column == "run" else "right")
    plain = next((r["voxels"] for r in rows if r["run"] == "plain"), 0)
    for r in rows:
        table.add_row(r["run"], str(r["edge"]), f"{r['peak_bytes'] / GIB:.2f}", f"{r['voxels']:,}",
                      f"{r['voxels'] / plain:.2f}" if plain else "-")
    return table


# --------------------------------------------------------------------------------------- --like-for-like
def like_for_like(plain_edges, wrapped_edges, repeat: int, batch: int, log, device_profile=None,
                  device_budget=None) -> list:
    """Each edge of each model simulated as TensorFlow runs it on a GPU_MEMORY GPU: grappler optimises for that
    size and swaps by itself when its estimate exceeds it (keras_lms/testing/grappler_swaps.py), ``repeat`` times
    because its choice of swaps varies from run to run; plus once on a 1 TiB GPU, where it never swaps (the
    figure the max-cube table used to give for plain). One row per (model, edge); ``device_budget``: the wrapped
    model planned for it (``--device-budget``)."""
    wrapped_kwargs = wrap_variants(False, device_profile=device_profile)["wrapped"]
    if device_budget:
        wrapped_kwargs = {**wrapped_kwargs, "device_budget": device_budget}
    rows = []
    for run, edges, kwargs in (("plain", plain_edges, None), ("wrapped", wrapped_edges, wrapped_kwargs)):
        for edge in edges:
            model = build(lambda e=edge: unet((e, e, e, 1), 16))
            x_shape, y_shape = shapes(model, batch)
            if kwargs is not None:
                model = keras_lms.wrap(model, **kwargs)
            unlimited = simulated_gpu.simulate(model, x_shape, y_shape, graph_memory=False, grappler_estimate=True)
            sims = [simulated_gpu.simulate(model, x_shape, y_shape, graph_memory=False, gpu_memory_bytes=GPU_MEMORY)
                    for _ in range(repeat)]
            row = dict(run=run, edge=edge, peak_unlimited=unlimited.peak_bytes,
                       grappler_estimate=unlimited.grappler_estimate_bytes,
                       peaks=[s.peak_bytes for s in sims], swaps=[len(s.grappler_swaps) for s in sims],
                       swap_bytes=[s.grappler_swap_bytes for s in sims],
                       fits=sum(s.peak_bytes <= GPU_MEMORY for s in sims), runs=repeat)
            log(f"  {run} {edge}^3: 1 TiB {row['peak_unlimited'] / GIB:.2f} GiB; grappler's estimate "
                f"{row['grappler_estimate'] / GIB:.2f} GiB; at {GPU_MEMORY / GIB:.0f} GiB "
                + ", ".join(f"{p / GIB:.2f} ({n} swaps, {b / GIB:.2f} GiB)"
                            for p, n, b in zip(row["peaks"], row["swaps"], row["swap_bytes"]))
                + f": fits {row['fits']}/{repeat}")
            rows.append(row)
    return rows


def reliable_edge(rows, run: str) -> int:
    """The largest edge of ``run`` that fits in every run, with every smaller edge tried fitting too (0: none)."""
    edge = 0
    for r in sorted((r for r in rows if r["run"] == run), key=lambda r: r["edge"]):
        if r["fits"] != r["runs"]:
            break
        edge = r["edge"]
    return edge


def _span(values, scale: float = GIB, digits: int = 2) -> str:
    """"low-high" of ``values`` / ``scale``, or one value when they print alike."""
    low, high = (f"{v / scale:.{digits}f}" for v in (min(values), max(values)))
    return low if low == high else f"{low}-{high}"


def like_for_like_table(rows, batch: int) -> Table:
    table = Table(title=f"3D U-Net (16 filters), batch {batch}, dtype policy "
                        f"{keras.mixed_precision.global_policy().name}: grappler optimises for a "
                        f"{GPU_MEMORY / GIB:.0f} GiB GPU and swaps by itself")
    for column in ("run", "edge", "peak, 1 TiB (no grappler swaps) GiB", "grappler's estimate GiB",
                   f"fits {GPU_MEMORY / GIB:.0f} GiB", "peaks GiB", "grappler swaps", "swapped GiB each way"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for r in rows:
        table.add_row(r["run"], f"{r['edge']}^3", f"{r['peak_unlimited'] / GIB:.2f}",
                      f"{r['grappler_estimate'] / GIB:.2f}", f"{r['fits']}/{r['runs']}", _span(r["peaks"]),
                      _span(r["swaps"], 1, 0), _span(r["swap_bytes"]))
    plain, wrapped = reliable_edge(rows, "plain"), reliable_edge(rows, "wrapped")
    if plain and wrapped:
        table.caption = (f"reliable (fits every run): plain {plain}^3, wrapped {wrapped}^3, "
                         f"{(wrapped / plain) ** 3:.2f}x the voxels")
    return table


# ------------------------------------------------------------------------------------------------- main
def run(args, console, log) -> dict:
    """The selected mode; returns its results for --json."""
    if args.like_for_like:
        edges = lambda text: [int(e) for e in text.split(",")] if text else []  # noqa: E731
        rows = like_for_like(edges(args.plain_edges), edges(args.wrapped_edges), args.repeat, args.batch, log,
                             args.device_profile, args.device_budget)
        console.print(like_for_like_table(rows, args.batch))
        return {"like_for_like": rows, "batch": args.batch, "gpu_memory": GPU_MEMORY,
                "dtype_policy": args.dtype_policy, "device_profile": args.device_profile,
                "reliable_edge": {run: reliable_edge(rows, run) for run in ("plain", "wrapped")}}
    if args.cube_edges:
        # the wrapped model (wrap's defaults, with --device-profile if given) at the listed edges only
        kwargs = wrap_variants(False, device_profile=args.device_profile)["wrapped"]
        if args.device_budget:
            kwargs["device_budget"] = args.device_budget
        peaks, reports = {}, {}
        for edge in (int(e) for e in args.cube_edges.split(",")):
            found = cube_peak_beside_report(edge, args.batch, kwargs)
            peaks[edge], reports[edge] = found["peak"], found["report"]
            live = ", ".join(f"{name} {size / GIB:.2f}" for size, name in found["live"])
            log(f"  edge {edge}: {peaks[edge] / GIB:.2f} GiB "
                f"{'fits' if peaks[edge] <= GPU_MEMORY else 'does not fit'} {GPU_MEMORY / GIB:.0f} GiB; "
                f"report {reports[edge] / GIB:.2f} GiB ({reports[edge] / peaks[edge] - 1:+.1%}); "
                f"largest live at the peak: {live}")
        return {"cube_peaks": {str(k): v for k, v in peaks.items()},
                "report_peaks": {str(k): v for k, v in reports.items()}, "batch": args.batch,
                "dtype_policy": args.dtype_policy, "device_profile": args.device_profile,
                "device_budget": args.device_budget}
    if args.max_cube:
        rows = max_cube(args.batch, args.forced, log, args.runs.split(",") if args.runs else None, args.start,
                        args.device_profile)
        console.print(max_cube_table(rows, args.batch))
        return {"max_cube": [{**r, "tried": {str(k): v for k, v in r["tried"].items()}} for r in rows],
                "batch": args.batch, "gpu_memory": GPU_MEMORY, "dtype_policy": args.dtype_policy}
    sanity, sanity_numbers = sanity_check(args.quick)
    console.print(sanity)
    rows = []
    for case in cases(args.quick):
        case_start = time.perf_counter()
        rows.extend(measure(case, wrap_variants(args.forced, args.quick)))
        log(f"{case.label}: {time.perf_counter() - case_start:.0f} s")
    console.print(results_table(rows))
    console.print(diagnostics_table(rows))
    models = [dict(model=r["model"], variant=r["variant"], sim_plain=r["plain"].peak_bytes,
                   sim_wrapped=r["wrapped"].peak_bytes, report_plain=r["report_plain"],
                   report_wrapped=r["report_wrapped"], swap_nodes_traced=r["wrapped"].swap_nodes_traced,
                   swap_nodes_optimized=r["wrapped"].swap_nodes_optimized,
                   host_to_gpu_bytes=r["wrapped"].gpu.received_bytes, gpu_to_host_bytes=r["wrapped"].gpu.sent_bytes,
                   seconds_plain=r["plain"].seconds, seconds_wrapped=r["wrapped"].seconds) for r in rows]
    return {"sanity_check": sanity_numbers, "models": models}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models: a smoke run")
    parser.add_argument("--forced", action="store_true", help="also wrap(min_bytes=0, keep_last=0)")
    parser.add_argument("--max-cube", action="store_true",
                        help="largest 3D U-Net cube that fits 16 GiB, plain vs wrapped")
    parser.add_argument("--batch", type=int, default=1, help="batch size for --max-cube (default 1)")
    parser.add_argument("--runs", default=None, help="--max-cube: only these runs, e.g. wrapped or plain,wrapped")
    parser.add_argument("--start", type=int, default=64, help="--max-cube: first edge tried (default 64)")
    parser.add_argument("--dtype-policy", default="float32",
                        help="Keras dtype policy of every model, plain and wrapped, e.g. mixed_float16 (default "
                             "float32); the loss is computed in float32 either way")
    parser.add_argument("--cube-edges", default=None,
                        help="instead: the wrapped 3D U-Net's simulated peak at these cube edges only, e.g. 400,416")
    parser.add_argument("--device-profile", default=None,
                        help="--max-cube / --cube-edges: wrap(device_profile=...) for the wrapped runs (the "
                             "time-aware plan)")
    parser.add_argument("--device-budget", default=None,
                        help="--cube-edges, --like-for-like: wrap(device_budget=...) too, e.g. 16GiB (the budget "
                             "planner's plan)")
    parser.add_argument("--like-for-like", action="store_true",
                        help="instead: plain and wrapped as TensorFlow runs them on a 16 GiB GPU (grappler swaps by "
                             "itself), --repeat times per edge")
    parser.add_argument("--plain-edges", default="", help="--like-for-like: plain cube edges, e.g. 240,256,272")
    parser.add_argument("--wrapped-edges", default="", help="--like-for-like: wrapped cube edges, e.g. 384,400")
    parser.add_argument("--repeat", type=int, default=3,
                        help="--like-for-like: runs per edge (grappler's swaps vary; default 3)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.dtype_policy)
    console = Console(width=200)
    log = lambda message: console.print(message, highlight=False)  # noqa: E731
    started = time.perf_counter()
    with simulated_host_ram():
        results = run(args, console, log)
    log(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
