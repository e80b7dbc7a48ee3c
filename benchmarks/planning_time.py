"""How long `wrap`'s planner takes on real architectures: `keras_lms.report` (the plan `wrap` makes, and its
report) timed on `keras.applications` models and the 3D U-Net, with a budget, and with a budget and a device
profile (the time-aware search: keep, copy or recompute per tensor).

    python benchmarks/planning_time.py                  # ResNet50, MobileNetV2, DenseNet121, 3D U-Net (~2 min)
    python benchmarks/planning_time.py --models resnet50 --json out.json
    python benchmarks/planning_time.py --smoke          # one small model (CI, seconds)

Why: the issue's bar is "a few seconds for a 100-call model"; the time-aware search predicts the step hundreds of
times per plan, so its cost grows faster than the call count, and a model with hundreds of calls (DenseNet121's
429) shows it first. Each row also prints the plan's predicted step and its ratio to the plain step, so that a
faster planner that plans worse shows. Timed on the machine it runs on; rows of one run compare.
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

# name -> (builder of the model at an input edge, edge, batch size, device budget)
MODELS = {
    "resnet50": (lambda e: keras.applications.ResNet50(weights=None, input_shape=(e, e, 3), classes=10),
                 1024, 4, "4GiB"),
    "mobilenetv2": (lambda e: keras.applications.MobileNetV2(weights=None, input_shape=(e, e, 3), classes=10),
                    1024, 4, "4GiB"),
    "densenet121": (lambda e: keras.applications.DenseNet121(weights=None, input_shape=(e, e, 3), classes=10),
                    896, 4, "4GiB"),
    "unet3d": (lambda e: unet((e, e, e, 1), 16), 384, 1, "16GiB"),
}
SMOKE = {"mobilenetv2": (MODELS["mobilenetv2"][0], 160, 4, "128MiB")}


def time_plans(name: str, build, edge: int, batch_size: int, budget: str, profile: str) -> list:
    model = build(edge)
    model.compile(optimizer="adam", loss="mse")
    rows = []
    for with_profile in (None, profile):
        began = time.perf_counter()
        rep = keras_lms.report(model, batch_size=batch_size, device_budget=budget, device_profile=with_profile)
        seconds = time.perf_counter() - began
        times = rep.times or {}
        planned, plain = times.get("as planned"), times.get("plain")
        rows.append(dict(model=name, layers=len(model.layers), calls=len(rep.rows), edge=edge,
                         batch_size=batch_size, budget=budget, profile=with_profile or "-", seconds=seconds,
                         step_seconds=planned.step_seconds if planned else None,
                         plain_seconds=plain.compute_seconds if plain else None))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--profile", default="h100-pcie5")
    parser.add_argument("--smoke", action="store_true", help="one small model (CI)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    chosen = SMOKE if args.smoke else {name: MODELS[name] for name in args.models.split(",")}
    rows = [row for name, spec in chosen.items() for row in time_plans(name, *spec, args.profile)]
    table = Table(title="planning time of wrap (keras_lms.report), this machine")
    for column in ("model", "calls", "input", "batch", "budget", "profile", "planning s", "predicted step",
                   "x plain"):
        table.add_column(column, justify="left" if column in ("model", "budget", "profile") else "right")
    for r in rows:
        step, plain = r["step_seconds"], r["plain_seconds"]
        table.add_row(r["model"], str(r["calls"]), f"{r['edge']}", str(r["batch_size"]), r["budget"], r["profile"],
                      f"{r['seconds']:.1f}", f"{step:.3f} s" if step else "-",
                      f"{step / plain:.2f}" if step and plain else "-")
    Console(width=140).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
