"""Predicted step time of the 3D U-Net's plans at the volumes users come for: plan x device profile x edge.

    python benchmarks/step_time.py                                  # float32 384^3, 400^3; mixed_float16 448^3, 496^3
    python benchmarks/step_time.py --edges 384 --dtype-policy float32 --json out.json
    python benchmarks/step_time.py --smoke                          # a small cube (CI, seconds)
    python benchmarks/step_time.py --no-held                        # the control: no sweep holds its units
    python benchmarks/step_time.py --slab-choice                    # wrap(device_profile=) vs none, 288^3 and
                                                                    # 320^3 float32, with simulated peaks (~5 min)
    python benchmarks/step_time.py --budget-curve --edges 384 --dtype-policy float32   # the plan at budgets of
                                                                    # 16-64 GiB: a larger one is never slower

The model is the max-cube benchmark's 3D U-Net (``benchmarks/simulated_gpu_peak.py``: 4 levels, 16 filters,
batch 1), planned for ``device_budget="16GiB"`` as ``wrap`` plans it, on the TensorFlow back end's memory facts.
Per edge and plan it prints the predicted peak (``keras_lms.report``), the host-link bytes each way
(``planning.traffic``, within 1% of the grappler-optimised graph: ``benchmarks/link_traffic.py``), the extra
convolution FLOPs (slab halos) and, per device profile, the predicted step and its ratio to the plain step's
compute (infinite memory). Plans: "plain" (what the step computes, infinitely large GPU), "as planned" (the
budget planner's choice, without and with ``device_profile``) and "offload-only" (every eligible tensor).
Nothing is executed: planning traces the model symbolically, in about a second per edge.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras
from rich.console import Console
from rich.table import Table

import keras_lms
from benchmarks.simulated_gpu_peak import simulated_host_ram, unet

GIB = float(1 << 30)
PROFILES = ("h100-pcie5", "gh200")
DEFAULT_EDGES = {"float32": (384, 400), "mixed_float16": (448, 496)}


def measure(edge: int, budget: str, profiles) -> list:
    """One row per (plan, profile) at ``edge``^3."""
    model = unet((edge, edge, edge, 1), 16)
    rows = []
    for profile in profiles:
        started = time.perf_counter()
        note = ""
        try:
            rep = keras_lms.report(model, batch_size=1, device_budget=budget, device_profile=profile)
        except keras_lms.BudgetError:
            # the planner keeps a 15% margin on its prediction; wrap's defaults (no budget) still offload
            # every eligible tensor, which is what the max-cube figures measure
            rep = keras_lms.report(model, batch_size=1, device_profile=profile)
            note = "budget planner refuses (15% margin): wrap defaults"
        planning_seconds = time.perf_counter() - started
        for plan, t in rep.times.items():
            rows.append(dict(edge=edge, profile=profile, plan=plan, step_seconds=t.step_seconds,
                             compute_seconds=rep.times["plain"].compute_seconds,
                             exposed_seconds=t.exposed_seconds, recompute_flops=t.recompute_flops,
                             flops=t.flops, device_to_host_bytes=t.device_to_host_bytes,
                             host_to_device_bytes=t.host_to_device_bytes,
                             peak_bytes=(rep.totals["predicted_peak_bytes_plain"] if plan == "plain"
                                         else rep.totals["predicted_peak_bytes_wrapped"] if plan == "as planned"
                                         else None),
                             planning_seconds=planning_seconds, note=note))
    return rows


def slab_choice(edges, budget: str, profile: str = "h100-pcie5") -> list:
    """The budget planner with and without ``device_profile``: its slab size, the prediction on ``profile`` and
    the simulated peak of the executed graph (``simulated_gpu_peak.cube_peak``, the budget's check)."""
    from benchmarks.simulated_gpu_peak import cube_peak
    from keras_lms.testing.logical_devices import HOST_STAND_IN

    rows = []
    for edge in edges:
        model = unet((edge, edge, edge, 1), 16)
        for chosen_with in (None, profile):
            config = keras_lms.LMSConfig(device_budget=budget, device_profile=chosen_with)
            rep = keras_lms.report(model, batch_size=1, config=config, device_profile=profile)
            slabs = sorted({r["reason"].split("slabs of ")[1].split(" along")[0] for r in rep.rows
                            if "slabs of" in r["reason"]}) or ["none (every call whole)"]
            peak = cube_peak(edge, 1, dict(host_device=HOST_STAND_IN, device_budget=budget,
                                           device_profile=chosen_with))
            t = rep.times["as planned"]
            rows.append(dict(edge=edge, profile=chosen_with or "none", slabs=", ".join(slabs),
                             host_to_device_bytes=t.host_to_device_bytes, recompute_flops=t.recompute_flops,
                             step_seconds=t.step_seconds, simulated_peak_bytes=peak))
    return rows


def slab_choice_table(rows, budget: str, profile: str = "h100-pcie5") -> Table:
    t = Table(title=f"slab size chosen by the budget planner ({budget}), float32; step predicted on {profile}")
    for column in ("edge", "device_profile", "slabs", "back GiB", "extra conv TFLOP", "step s", "simulated peak GiB"):
        t.add_column(column, justify="left" if column in ("device_profile", "slabs") else "right")
    for r in rows:
        t.add_row(f"{r['edge']}^3", r["profile"], r["slabs"], f"{r['host_to_device_bytes'] / GIB:.1f}",
                  f"{r['recompute_flops'] / 1e12:.2f}", f"{r['step_seconds']:.3f}",
                  f"{r['simulated_peak_bytes'] / GIB:.2f}")
    return t


CURVE_BUDGETS = ("16GiB", "20GiB", "24GiB", "28GiB", "32GiB", "40GiB", "48GiB", "64GiB")


def budget_curve(edge: int, budgets, profiles) -> list:
    """The budget planner's plan of the ``edge``^3 U-Net at each budget and profile: its predicted step against
    the plain step's, its bytes back and its planning time (a plan that fits a budget fits every larger one, so
    the step should never grow with the budget)."""
    model = unet((edge, edge, edge, 1), 16)
    rows = []
    for profile in profiles:
        for budget in budgets:
            started = time.perf_counter()
            try:
                rep = keras_lms.report(model, batch_size=1, device_budget=budget, device_profile=profile)
            except keras_lms.BudgetError:
                rows.append(dict(edge=edge, profile=profile, budget=budget, ratio=None))
                continue
            t = rep.times["as planned"]
            rows.append(dict(edge=edge, profile=profile, budget=budget,
                             ratio=t.step_seconds / rep.times["plain"].step_seconds, step_seconds=t.step_seconds,
                             host_to_device_bytes=t.host_to_device_bytes, recompute_flops=t.recompute_flops,
                             peak_bytes=rep.totals["predicted_peak_bytes_wrapped"],
                             planning_seconds=time.perf_counter() - started))
    return rows


def budget_curve_table(rows, policy: str) -> Table:
    t = Table(title=f"3D U-Net (16 filters, batch 1), {policy}: the budget plan at each device_budget")
    for column in ("edge", "profile", "budget", "x plain compute", "step s", "back GiB", "extra conv TFLOP",
                   "peak GiB", "planning s"):
        t.add_column(column, justify="left" if column == "profile" else "right")
    for r in rows:
        if r["ratio"] is None:
            t.add_row(f"{r['edge']}^3", r["profile"], r["budget"], "does not fit", *["-"] * 5)
            continue
        t.add_row(f"{r['edge']}^3", r["profile"], r["budget"], f"{r['ratio']:.2f}", f"{r['step_seconds']:.3f}",
                  f"{r['host_to_device_bytes'] / GIB:.1f}", f"{r['recompute_flops'] / 1e12:.2f}",
                  f"{r['peak_bytes'] / GIB:.1f}", f"{r['planning_seconds']:.1f}")
    return t


def table(rows, policy: str, budget: str) -> Table:
    t = Table(title=f"3D U-Net (16 filters, batch 1), device_budget={budget}, {policy}: predicted per step")
    for column in ("edge", "profile", "plan", "peak GiB", "to host GiB", "back GiB", "extra conv TFLOP",
                   "exposed s", "step s", "x plain compute"):
        t.add_column(column, justify="left" if column in ("profile", "plan") else "right")
    for r in rows:
        t.add_row(f"{r['edge']}^3", r["profile"], r["plan"] + (f" ({r['note']})" if r["note"] else ""),
                  "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GIB:.1f}",
                  f"{r['device_to_host_bytes'] / GIB:.1f}", f"{r['host_to_device_bytes'] / GIB:.1f}",
                  f"{r['recompute_flops'] / 1e12:.2f}", f"{r['exposed_seconds']:.3f}", f"{r['step_seconds']:.3f}",
                  f"{r['step_seconds'] / r['compute_seconds']:.2f}")
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype-policy", default=None, help="float32 or mixed_float16 (default: both)")
    parser.add_argument("--edges", default=None, help="comma-separated cube edges (default: per dtype policy)")
    parser.add_argument("--budget", default="16GiB")
    parser.add_argument("--smoke", action="store_true", help="one small cube with a small budget (CI)")
    parser.add_argument("--slab-choice", action="store_true",
                        help="the planner's slab size with and without device_profile, with simulated peaks")
    parser.add_argument("--budget-curve", action="store_true",
                        help=f"the plan at each budget of {', '.join(CURVE_BUDGETS)} (one edge, one dtype policy)")
    parser.add_argument("--no-held", action="store_true",
                        help="offer the planner no held convolution outputs in level sweeps (the control of "
                             "sweeps.Sweep.held)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    console = Console(width=200)
    if args.no_held:
        from keras_lms.offload.tensorflow import sweeps
        sweeps.hold_options = lambda calls, units: ()
    if args.budget_curve:
        policy = args.dtype_policy or "float32"
        keras.mixed_precision.set_global_policy(policy)
        edge = int(args.edges.split(",")[0]) if args.edges else DEFAULT_EDGES[policy][0]
        with simulated_host_ram():
            rows = budget_curve(edge, CURVE_BUDGETS, PROFILES)
        keras.mixed_precision.set_global_policy("float32")
        console.print(budget_curve_table(rows, policy))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    if args.slab_choice:
        keras.mixed_precision.set_global_policy("float32")
        edges = [int(e) for e in args.edges.split(",")] if args.edges else [288, 320]
        with simulated_host_ram():
            rows = slab_choice(edges, args.budget)
        console.print(slab_choice_table(rows, args.budget))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    policies = [args.dtype_policy] if args.dtype_policy else list(DEFAULT_EDGES)
    results = []
    with simulated_host_ram():
        for policy in policies:
            keras.mixed_precision.set_global_policy(policy)
            edges = ([int(e) for e in args.edges.split(",")] if args.edges
                     else [64] if args.smoke else DEFAULT_EDGES[policy])
            budget = "256MiB" if args.smoke else args.budget
            rows = [r for edge in edges for r in measure(edge, budget, PROFILES)]
            console.print(table(rows, policy, budget))
            results.extend({**r, "dtype_policy": policy, "budget": budget} for r in rows)
    keras.mixed_precision.set_global_policy("float32")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
