"""What benchmarks/gpu_bench.py writes: its log lines (seconds since start), ``results.json`` and ``results.md``.

:class:`Results` holds the run's meta data (versions, device, flags) and every measurement as it arrives;
``save()`` rewrites both files atomically after each one, so an interrupted run still leaves what it measured
(``"complete": false``). :func:`to_markdown` renders the tables of docs/benchmarks.md from ``results.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch

import keras_lms
from keras_lms.planning import copy_back_leads

GIB = float(1 << 30)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


# ----------------------------------------------------------------------------------------------- results
class Results:
    def __init__(self, out: pathlib.Path, args):
        self.out = out
        self.data = {
            "meta": {
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "args": vars(args),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "keras": keras.__version__,
                "keras_lms": keras_lms.__version__,
                "backend": keras.backend.backend(),
                "cuda": torch.cuda.is_available(),
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "device_total_gib": (torch.cuda.get_device_properties(0).total_memory / GIB
                                     if torch.cuda.is_available() else None),
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "complete": False,
                "elapsed_s": 0.0,
                # whether the planner that ran started copies back per call (gpu_replay replays the plans as they ran)
                "copy_back_leads": copy_back_leads.COPY_BACK_LEADS,
            },
            "bandwidth": None,
            "max_edge": {"plain": None, "lms": None, "voxel_ratio": None, "target_voxel_ratio": 10.0},
            "timing": [],
            "errors": [],
        }

    def save(self):
        self.data["meta"]["elapsed_s"] = round(elapsed(), 1)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable))
        tmp.replace(self.out / "results.json")
        (self.out / "results.md").write_text(to_markdown(self.data))


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, pathlib.Path):
        return str(value)
    return str(value)


def _fmt(value, spec=".2f", none="n/a"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def to_markdown(data) -> str:
    meta = data["meta"]
    lines = [
        "# keras-lms GPU benchmark (torch back end)",
        "",
        f"Device: {meta['device']} ({_fmt(meta['device_total_gib'], '.0f')} GiB); torch {meta['torch']}, "
        f"Keras {meta['keras']}, keras-lms {meta['keras_lms']}; cap {meta['args']['cap_gib']} GiB; "
        f"3D U-Net depth {meta['args']['depth']}, {meta['args']['base_filters']} base filters, batch "
        f"{meta['args']['batch']}; {'complete' if meta['complete'] else 'INCOMPLETE (partial results)'} "
        f"after {meta['elapsed_s']:.0f} s.",
        "",
        "## Transfer bandwidth (GB/s)",
        "",
    ]
    bw = data["bandwidth"]
    if bw is None:
        lines.append("not measured")
    elif bw.get("skipped"):
        lines.append(f"skipped: {bw['skipped']}")
    else:
        lines += ["| host->device (pinned) | device->host (pinned) | device->device copy | buffer |",
                  "| --- | --- | --- | --- |",
                  f"| {_fmt(bw['h2d_gbps'], '.1f')} | {_fmt(bw['d2h_gbps'], '.1f')} | {_fmt(bw['d2d_gbps'], '.1f')} | "
                  f"{bw['bytes'] / GIB:.2f} GiB |"]
    lines += ["", f"## Largest trainable cube edge under a {meta['args']['cap_gib']} GiB cap", ""]
    me = data["max_edge"]
    rows = []
    for mode in ("plain", "lms"):
        r = me.get(mode)
        if r is None:
            continue
        rows.append(f"| {mode} | {r['edge'] or 'none'} | {_fmt(r['voxels'] / 1e6 if r['voxels'] else None, '.2f')} | "
                    f"{r['first_failure'] or 'none'} | {r['stopped']} | {len(r['trials'])} |")
    if rows:
        lines += ["| mode | largest edge | Mvoxels | first failing edge | ladder stopped by | trials |",
                  "| --- | --- | --- | --- | --- | --- |"] + rows
        lines += ["", f"Voxel ratio wrapped / plain: **{_fmt(me['voxel_ratio'], '.2f')}** "
                      f"(target >= {me['target_voxel_ratio']:.0f})."]
        trials = [(mode, t) for mode in ("plain", "lms") if me.get(mode) for t in me[mode]["trials"]]
        lines += ["", "| mode | edge | result | step s | peak GiB |", "| --- | --- | --- | --- | --- |"]
        for mode, t in trials:
            status = 'ok' if t['ok'] else t['error']
            lines.append(f"| {mode} | {t['edge']} | {status} | {_fmt(t.get('seconds'), '.1f')} "
                         f"| {_fmt(t.get('peak_gib'), '.2f')} |")
    else:
        lines.append("not measured")
    lines += ["", "## Step time at sizes that fit both ways", ""]
    if data["timing"]:
        lines += ["| edge | plain ms | wrapped ms | plain peak GiB | wrapped peak GiB | offloaded GiB/step | "
                  "D2H GiB | H2D GiB | lower bound ms | wrapped / lower bound | wrapped / plain |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for t in data["timing"]:
            lines.append(
                f"| {t['edge']} | {_fmt(t['plain_ms'], '.1f')} | {_fmt(t['lms_ms'], '.1f')} | "
                f"{_fmt(t['plain_peak_gib'], '.2f')} | {_fmt(t['lms_peak_gib'], '.2f')} | "
                f"{_fmt(t['offloaded_gib'], '.3f')} | {_fmt(t['d2h_gib'], '.3f')} | {_fmt(t['h2d_gib'], '.3f')} | "
                f"{_fmt(t['lower_bound_ms'], '.1f')} | **{_fmt(t['ratio_to_lower_bound'], '.3f')}** | "
                f"{_fmt(t['ratio_to_plain'], '.3f')} |")
        lines += ["", "Lower bound: max(plain step, offloaded bytes / D2H bandwidth + offloaded bytes / H2D "
                      "bandwidth); target wrapped / lower bound <= 1.10.", "",
                  "Predicted by `keras_lms.report(wrapped, device_profile=<profile.json of this run>)`:", "",
                  "| edge | plain ms | predicted | wrapped ms | predicted | D2H GiB | predicted | H2D GiB "
                  "| predicted |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for t in data["timing"]:
            if "predicted_lms_ms" not in t:
                continue
            lines.append(
                f"| {t['edge']} | {_fmt(t['plain_ms'], '.1f')} | {_fmt(t['predicted_plain_ms'], '.1f')} | "
                f"{_fmt(t['lms_ms'], '.1f')} | {_fmt(t['predicted_lms_ms'], '.1f')} | {_fmt(t['d2h_gib'], '.3f')} | "
                f"{_fmt(t['predicted_d2h_gib'], '.3f')} | {_fmt(t['h2d_gib'], '.3f')} | "
                f"{_fmt(t['predicted_h2d_gib'], '.3f')} |")
        timed = [t for t in data["timing"] if "timed_ms" in t]
        if timed:
            lines += ["", "The time-aware plan, `keras_lms.wrap(model, device_profile=<profile.json of this run>)` "
                          "(activations after BatchNorms recomputed in their readers' backward instead of "
                          "copied), beside offload-only (`wrap` defaults) and its own prediction:", "",
                      "| edge | offload-only ms | time-aware ms | predicted | time-aware / plain | "
                      "time-aware / offload-only | recomputed (planned) | peak GiB | D2H GiB | predicted | "
                      "H2D GiB | predicted |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for t in timed:
                lines.append(
                    f"| {t['edge']} | {_fmt(t['lms_ms'], '.1f')} | {_fmt(t['timed_ms'], '.1f')} | "
                    f"{_fmt(t['predicted_timed_ms'], '.1f')} | {_fmt(t['timed_ratio_to_plain'], '.3f')} | "
                    f"**{_fmt(t['timed_ratio_to_lms'], '.3f')}** | {t['timed_recomputed']} "
                    f"({t['timed_recomputed_planned']}) | {_fmt(t['timed_peak_gib'], '.2f')} | "
                    f"{_fmt(t['timed_d2h_gib'], '.3f')} | {_fmt(t['predicted_timed_d2h_gib'], '.3f')} | "
                    f"{_fmt(t['timed_h2d_gib'], '.3f')} | {_fmt(t['predicted_timed_h2d_gib'], '.3f')} |")
    else:
        lines.append("not measured")
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in data["errors"]]
    return "\n".join(lines) + "\n"

