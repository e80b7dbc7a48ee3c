"""The largest input the budget planner fits, per dtype policy, budget and device profile: `keras_lms.largest_input`
on the 3D U-Net of the other benchmarks (depth 4, 16 filters, batch 1), beside plain Keras' largest by the same rule.

    python benchmarks/largest_input.py                      # 16 GiB and 24 GiB, float32 and mixed_float16 (~2 min)
    python benchmarks/largest_input.py --budgets 16GiB --profiles gh200 --json out.json

Each row is one search (probes, seconds); the predicted step is the answer's on the profile, and "x plain" divides
it by the plain step's at the same shape (infinite memory). What the answers peak at in the executed graph:
`benchmarks/simulated_gpu_peak.py --like-for-like --wrapped-edges E --device-budget B --device-profile P`
(docs/benchmarks.md, "The largest input that fits").
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
from benchmarks.models import unet


def search(policy: str, budget: str, profile: str, start: int) -> dict:
    keras.mixed_precision.set_global_policy(policy)
    try:
        began = time.perf_counter()
        found = keras_lms.largest_input(unet((None, None, None, 1), 16), 1, budget, input_shape=(start,) * 3 + (1,),
                                        device_profile=profile)
        seconds = time.perf_counter() - began
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return dict(policy=policy, budget=budget, profile=profile, seconds=seconds, **found.to_dict())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="16GiB,24GiB")
    parser.add_argument("--policies", default="float32,mixed_float16")
    parser.add_argument("--profiles", default="h100-pcie5")
    parser.add_argument("--start", type=int, default=64, help="the start edge (default 64)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [search(policy, budget, profile, args.start) for budget in args.budgets.split(",")
            for profile in args.profiles.split(",") for policy in args.policies.split(",")]
    table = Table(title="largest input that fits (3D U-Net, 16 filters, batch 1)")
    for column in ("budget", "profile", "dtype policy", "largest", "refused", "plain Keras", "peak with margin",
                   "predicted step", "x plain", "probes", "seconds"):
        table.add_column(column, justify="left" if column in ("budget", "profile", "dtype policy") else "right")
    edge = lambda shape: f"{shape[0]}^3" if shape else "-"  # noqa: E731
    for r in rows:
        totals = r["totals"]
        step, plain = totals.get("predicted_step_seconds"), totals.get("predicted_step_seconds_plain")
        table.add_row(r["budget"], r["profile"], r["policy"], edge(r["input_shape"]), edge(r["refused_shape"]),
                      edge(r["plain_input_shape"]), f"{totals.get('budget_peak_bytes', 0) / 2**30:.2f} GiB",
                      f"{step:.3f} s" if step else "-", f"{step / plain:.2f}" if step else "-",
                      str(len(r["probes"])), f"{r['seconds']:.1f}")
    Console(width=160).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
