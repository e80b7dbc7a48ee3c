"""Host-link traffic of a wrapped step: ``keras_lms.report``'s prediction against the tensors that cross between
the host and the compute device in the graph grappler optimises for a virtual GPU.

    python benchmarks/link_traffic.py            # 2D/3D U-Nets, forced offload, whole and in slabs (~2 min)
    python benchmarks/link_traffic.py --json out.json
    python benchmarks/link_traffic.py --edge 384                           # the max-cube U-Net, ~10 min
    python benchmarks/link_traffic.py --edge 448 --dtype-policy mixed_float16

Each case is simulated plain and wrapped (``keras_lms/testing/simulated_gpu.py``: the step is traced, optimised
by grappler's default pipeline for a virtual GPU + host and replayed by its virtual scheduler). The measured
traffic is what the virtual GPU sends and receives in the wrapped step minus the plain step's (the plain step
moves only its own feeds, if any). It is set beside the report's ``device_to_host_bytes_per_step`` and
``host_to_device_bytes_per_step`` and beside the count the report gave before it modelled copies back per
reading backward and slab halos (each tensor out once, in once per offloaded input: "old count").
tests/offload/tensorflow/test_link_traffic.py runs it and asserts the report within 10% of the measurement,
and the old count outside it where slabs are used (the test's negative control).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from keras_lms.testing.logical_devices import HOST_STAND_IN, configure_logical_cpus

configure_logical_cpus()

import keras  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import keras_lms  # noqa: E402
from benchmarks.simulated_gpu_peak import build, shapes, simulated_host_ram, unet  # noqa: E402
from keras_lms.testing import simulated_gpu  # noqa: E402

MIB = float(1 << 20)
TIMING_PROFILE = "h100-pcie5"
FORCED = dict(host_device=HOST_STAND_IN, min_bytes=0, keep_last=0)


def cases() -> list:
    """(label, model builder, batch, wrap settings, fused slab chains[, exact-row convolutions[, sweeps]]). The
    slab cases cut every large call in 4-8 slabs; "unfused" turns the fused BatchNorm -> ReLU -> convolution
    chains off (slab_chains.ENABLED); "halo rows convolved" turns exact-row convolution slabs off
    (slab_plan.EXACT_ROWS: every slab convolves its whole window "same" and crops, the control of slab_rows);
    "no sweeps" offers the time-aware planner no level sweep (sweeps.ENABLED), the control of sweeps; "swept" and
    "swept, held" sweep every run, the second holding its convolution outputs between the passes; "pooling not
    folded" differentiates the skip's max pooling itself (sweeps.FOLD_POOLING, or pooling_folds.ENABLED where no
    level is swept), the control of the fold. (The 2D
    U-Net's whole case and its controls, unfused, halo rows convolved and no sweeps, left in session 26 for CI's
    time: they agreed with the 3D ones, docs/benchmarks.md.)"""
    unet3d = lambda: unet((32, 32, 32, 1), 4, levels=2)  # noqa: E731
    unet2d = lambda: unet((64, 64, 1), 8, levels=2)  # noqa: E731
    slabs3d, slabs2d = {**FORCED, "slab_bytes": 64 << 10}, {**FORCED, "slab_bytes": 32 << 10}
    return [("3D U-Net 1x32^3 (2 levels, 4 filters), whole", unet3d, 1, FORCED, True),
            ("3D U-Net 1x32^3, slabs of 64 KiB, unfused", unet3d, 1, slabs3d, False),
            ("3D U-Net 1x32^3, slabs of 64 KiB, fused chains", unet3d, 1, slabs3d, True),
            ("3D U-Net 1x32^3, slabs of 64 KiB, fused chains, halo rows convolved", unet3d, 1, slabs3d, True, False),
            ("2D U-Net 2x64x64 (2 levels, 8 filters), slabs of 32 KiB, fused chains", unet2d, 2, slabs2d, True),
            # the time-aware plan on a PCIe profile: level-0 tensors recomputed in windows (planning.recompute)
            ("3D U-Net 1x32^3, slabs of 64 KiB, recomputed (h100-pcie5)", unet3d, 1,
             {**slabs3d, "device_profile": "h100-pcie5"}, True),
            ("2D U-Net 2x64x64, slabs of 32 KiB, recomputed (h100-pcie5)", unet2d, 2,
             {**slabs2d, "device_profile": "h100-pcie5"}, True),
            ("3D U-Net 1x32^3, slabs of 64 KiB, recomputed (h100-pcie5), no sweeps", unet3d, 1,
             {**slabs3d, "device_profile": "h100-pcie5"}, True, True, False),
            # every level swept, without and with its convolution outputs held between the passes (sweeps.FORCED,
            # HELD_FORCED): the control and the held plan differ in nothing else
            ("3D U-Net 1x32^3, slabs of 64 KiB, swept", unet3d, 1, slabs3d, True, True, True, False),
            ("3D U-Net 1x32^3, slabs of 64 KiB, swept, held", unet3d, 1, slabs3d, True, True, True, True),
            ("3D U-Net 1x32^3, slabs of 64 KiB, swept, pooling not folded", unet3d, 1, slabs3d, True, True, True,
             False, False),
            # not swept (no profile): the skip's pooling folded into its ReLU's slab backward, and the control
            ("3D U-Net 1x32^3, slabs of 64 KiB, fused chains, pooling not folded", unet3d, 1, slabs3d, True, True,
             True, None, True, False)]


def large_cases(edge: int, profile: str, device_budget: str = "16GiB") -> list:
    """The max-cube benchmark's 3D U-Net (4 levels, 16 filters) at ``edge``^3, planned for ``device_budget`` as
    wrap plans it: today's plan (no profile) and the time-aware one on ``profile``."""
    cube = lambda: unet((edge, edge, edge, 1), 16)  # noqa: E731
    budget = dict(host_device=HOST_STAND_IN, device_budget=device_budget)
    return [(f"3D U-Net 1x{edge}^3, {device_budget}, no profile", cube, 1, budget, True),
            (f"3D U-Net 1x{edge}^3, {device_budget}, recomputed ({profile})", cube, 1,
             {**budget, "device_profile": profile}, True)]


_PLAIN = {}


def _plain_simulation(builder, batch, model, x_shape, y_shape):
    """The plain step's simulation, once per model and batch: the cases of one model differ only in how it is
    wrapped, and the plain graph grappler optimises is the same for all of them (about a third of the run)."""
    key = (builder, batch)
    if key not in _PLAIN:
        _PLAIN[key] = simulated_gpu.simulate(model, x_shape, y_shape, graph_memory=False)
    return _PLAIN[key]


def measure(label, builder, batch, settings, fused, exact=True, sweep=True, held=None, fold=True,
            pooling_fold=True) -> dict:
    from keras_lms.offload.tensorflow import pooling_folds, slab_chains, slab_plan, sweeps

    model = build(builder)
    x_shape, y_shape = shapes(model, batch)
    plain = _plain_simulation(builder, batch, model, x_shape, y_shape)
    slab_chains.ENABLED = fused  # read when the wrapped model plans (below) and when the report plans
    slab_plan.EXACT_ROWS = exact
    sweeps.ENABLED, sweeps.FOLD_POOLING, pooling_folds.ENABLED = sweep, fold, pooling_fold
    if held is not None:  # every sweep forced, its units held or not
        sweeps.FORCED, sweeps.HELD_FORCED = True, held
    try:
        wrapped = keras_lms.wrap(model, **settings)
        sim = simulated_gpu.simulate(wrapped, x_shape, y_shape, graph_memory=False)
        # timed on a profile only to read the plan's own recompute FLOPs (a wrapped model's plan is kept as is)
        rep = keras_lms.report(wrapped, batch_size=batch, input_shape=x_shape[1:], device_profile=TIMING_PROFILE)
    finally:
        slab_chains.ENABLED = slab_plan.EXACT_ROWS = sweeps.ENABLED = sweeps.FOLD_POOLING = pooling_folds.ENABLED = True
        sweeps.FORCED = sweeps.HELD_FORCED = False
    old = rep.totals["host_bytes_per_step"] + sum(r["offloaded_bytes"] for r in rep.rows)
    return dict(case=label,
                measured_out=sim.gpu.sent_bytes - plain.gpu.sent_bytes,
                measured_in=sim.gpu.received_bytes - plain.gpu.received_bytes,
                report_out=rep.totals["device_to_host_bytes_per_step"],
                report_in=rep.totals["host_to_device_bytes_per_step"],
                old_count=old, slabs=sum("slabs" in r["reason"] for r in rep.rows), fused=fused, exact_rows=exact,
                fused_chains=sum(r["decision"] == "recompute" for r in rep.rows),
                recomputed=sum(e.recomputed_output for e in wrapped.lms_plan or wrapped.plan(batch)),
                swept=sum(e.sweep is not None for e in wrapped.lms_plan or wrapped.plan(batch)),
                held=sum(len(e.sweep_held) for e in wrapped.lms_plan or wrapped.plan(batch) if e.sweep
                         and e.index == e.sweep[0]),
                folded=sum(1 for e in wrapped.lms_plan or wrapped.plan(batch) if e.sweep_folded
                           and e.index == e.sweep[0]),
                pooling_folds=sum(1 for e in wrapped.lms_plan or wrapped.plan(batch) if e.folded_pooling
                                  and e.sweep is None),
                peak=sim.peak_bytes, report_peak=rep.totals["predicted_peak_bytes_wrapped"],
                report_recompute_flops=rep.times["as planned"].recompute_flops,
                measured_recompute_flops=sim.conv_flops - plain.conv_flops, plain_conv_flops=plain.conv_flops,
                report_plain_flops=rep.times["plain"].flops,
                conv_ops_unknown=sim.conv_ops_unknown + plain.conv_ops_unknown)


def table(rows) -> Table:
    t = Table(title="host-link bytes per step (MiB): report vs the grappler-optimised graph on a virtual GPU")
    for column in ("case", "slab calls", "recompute decisions", "swept calls", "measured out", "report out",
                   "measured in", "report in", "report error", "old count (in+out)", "old count error",
                   "simulated peak MiB", "report peak MiB", "extra conv GFLOP measured", "report recompute GFLOP"):
        t.add_column(column, justify="left" if column == "case" else "right")
    for r in rows:
        measured = r["measured_out"] + r["measured_in"]
        error = (r["report_out"] + r["report_in"]) / measured - 1
        t.add_row(r["case"], str(r["slabs"]), str(r["fused_chains"]), str(r["swept"]),
                  f"{r['measured_out'] / MIB:.2f}",
                  f"{r['report_out'] / MIB:.2f}",
                  f"{r['measured_in'] / MIB:.2f}", f"{r['report_in'] / MIB:.2f}", f"{error:+.1%}",
                  f"{r['old_count'] / MIB:.2f}", f"{r['old_count'] / measured - 1:+.1%}",
                  f"{r['peak'] / MIB:,.0f}", f"{r['report_peak'] / MIB:,.0f}",
                  f"{r['measured_recompute_flops'] / 1e9:,.2f}", f"{r['report_recompute_flops'] / 1e9:,.2f}")
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON here")
    parser.add_argument("--edge", type=int, help="instead: the max-cube 3D U-Net at EDGE^3 with "
                        "device_budget=16GiB (--device-budget), without and with --profile (a few minutes per plan)")
    parser.add_argument("--dtype-policy", default="float32", choices=("float32", "mixed_float16"))
    parser.add_argument("--profile", default="h100-pcie5", help="device profile of the time-aware plan")
    parser.add_argument("--device-budget", default="16GiB", help="--edge: the plans' device_budget")
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.dtype_policy if args.edge else "float32")
    with simulated_host_ram():
        chosen = large_cases(args.edge, args.profile, args.device_budget) if args.edge else cases()
        rows = [measure(*case) for case in chosen]
    Console(width=260).print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
