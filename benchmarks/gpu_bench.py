"""GPU benchmark of keras-lms on the torch back end: transfer bandwidth, largest trainable 3D volume with and
without LMS under a device-memory cap, and step time against the transfer lower bound.

    KERAS_BACKEND=torch python -m benchmarks.gpu_bench --out runs/gpu            # one GPU, < 8 minutes
    KERAS_BACKEND=torch python -m benchmarks.gpu_bench --smoke --out /tmp/bench  # CPU, tiny sizes (CI)

Run it from the repository root (on a GPU machine: the repository carried there). Writes ``results.json`` and
``results.md`` under ``--out``, rewritten after every measurement, so an interrupted run still leaves what it
measured (``"complete": false``). Sections:

1. bandwidth: pinned host->device, device->host (on a side stream, as keras-lms copies) and device->device
   copy bandwidth, GB/s (1e9 bytes).
2. largest edge: the 3D U-Net of ``examples/unet.py`` (its twin in ``benchmarks/models.py``) at cube edges
   divisible by ``2**depth``, one training step (``train_on_batch``) per trial under
   ``torch.cuda.set_per_process_memory_fraction`` (``--cap-gib``), plain and wrapped (``keras_lms.wrap``
   defaults); edges grow by ~1.26 (2x voxels) until a step runs out of memory, then bisect. Reports the ratio
   of voxels (target >= 10).
3. step time at two edges that fit both ways (~80% and ~50% of the plain model's largest volume): median
   step time plain and wrapped (steps alternate, same weights), peak
   device memory (``torch.cuda.max_memory_allocated``), offloaded bytes per step (the plan) and the bytes
   actually copied, and the lower bound ``max(plain step, offloaded/BW_d2h + offloaded/BW_h2d)`` (each
   offloaded byte goes out and comes back); reports wrapped / lower bound (target <= 1.10).

Imports only keras (torch back end), torch, numpy, keras_lms and benchmarks/models.py (no TensorFlow).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import signal
import statistics
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch

import keras_lms
from keras_lms.offload import torch as lms_torch

try:
    from benchmarks.models import build_unet
except ModuleNotFoundError as err:  # run as a file: the repository root is not on sys.path
    if err.name != "benchmarks":
        raise
    raise SystemExit("run it from the repository root as a module: python -m benchmarks.gpu_bench ...") from err

GIB = float(1 << 30)
T0 = time.perf_counter()


class BudgetExceeded(Exception):
    """The run's time budget is spent (raised by the alarm between trials or inside a long one)."""


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
                      "bandwidth); target wrapped / lower bound <= 1.10."]
    else:
        lines.append("not measured")
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in data["errors"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- bandwidth
def measure_bandwidth(nbytes: int, reps: int) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device", "h2d_gbps": None, "d2h_gbps": None, "d2d_gbps": None, "bytes": 0}
    n = nbytes // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.fill_(1.0)
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    dev2 = torch.empty(n, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()

    def timed(fn):
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                start.record(stream)
                fn()
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(times[1:]) / 1e9

    result = {
        "h2d_gbps": timed(lambda: dev.copy_(host, non_blocking=True)),
        "d2h_gbps": timed(lambda: host.copy_(dev, non_blocking=True)),
        "d2d_gbps": timed(lambda: dev2.copy_(dev, non_blocking=True)),
        "bytes": nbytes,
        "reps": reps,
        "skipped": None,
    }
    host = dev = dev2 = None
    torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------------------------------ trials
def _is_oom(err: BaseException) -> bool:
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("out of memory", "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED",
                            "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "cudaErrorMemoryAllocation"))


def _free():
    gc.collect()
    lms_torch.clear_host_pool()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # Pinned blocks of earlier sizes stay cached by torch's host allocator (rounded up to powers of two).
        host_empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                      or getattr(torch._C, "_host_emptyCache", None))
        if host_empty is not None:
            host_empty()


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib():
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None


def make_data(edge: int, batch: int):
    gen = torch.Generator(device="cpu").manual_seed(edge)
    x = torch.rand((batch, edge, edge, edge, 1), generator=gen).to(_device())
    y = (torch.rand((batch, edge, edge, edge, 1), generator=gen) > 0.5).float().to(_device())
    return x, y


def build_pair(edge: int, args, wrap: bool):
    keras.backend.clear_session()
    torch.manual_seed(0)  # (keras.utils.set_random_seed would import TensorFlow where it is installed)
    model = build_unet((edge, edge, edge, 1), depth=args.depth, base_filters=args.base_filters)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="binary_crossentropy")
    wrapped = None
    if wrap:
        wrapped = keras_lms.wrap(model, min_bytes=args.min_bytes)
        wrapped.compile(optimizer=keras.optimizers.SGD(1e-3), loss="binary_crossentropy")
    return model, wrapped


def try_step(mode: str, edge: int, args) -> dict:
    """One training step of the U-Net at ``edge`` (plain or wrapped); ok or the kind of failure."""
    trial = {"edge": edge, "ok": False, "error": None, "seconds": None, "peak_gib": None}
    model = wrapped = x = y = None
    _free()
    try:
        limit = args.simulate_oom_mvoxels.get(mode)
        if limit is not None and edge ** 3 * args.batch > limit * 1e6:  # CI: exercise the failure path on CPU
            raise torch.OutOfMemoryError(f"simulated: more than {limit} Mvoxels ({mode})")
        model, wrapped = build_pair(edge, args, wrap=(mode == "lms"))
        x, y = make_data(edge, args.batch)
        _reset_peak()
        start = time.perf_counter()
        (wrapped or model).train_on_batch(x, y)
        _sync()
        trial.update(ok=True, seconds=time.perf_counter() - start, peak_gib=_peak_gib())
        if wrapped is not None:
            trial["offloaded_gib"] = wrapped.offloaded_bytes_per_step / GIB
    except BudgetExceeded:
        raise
    except Exception as err:
        if _is_oom(err):
            trial["error"] = "host memory" if "host memory" in str(err) else "device OOM"
        else:
            trial["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            trial["traceback"] = traceback.format_exc()[-3000:]
        trial["peak_gib"] = _peak_gib()
        err = None
    finally:
        del model, wrapped, x, y
        _free()
    return trial


def largest_edge(mode: str, args, start_edge: int, deadline: float, results: Results) -> dict:
    """Grow the edge by ~2x voxels until a step fails, then bisect (edges are multiples of 2**depth)."""
    unit = 2 ** args.depth
    record = {"edge": None, "voxels": None, "first_failure": None, "stopped": None, "trials": []}
    results.data["max_edge"][mode] = record
    k = max(1, start_edge // unit)
    ok_k, fail_k = None, None

    def run(k):
        edge = k * unit
        log(f"{mode}: trying edge {edge} ({edge ** 3 * args.batch / 1e6:.1f} Mvoxels)")
        trial = try_step(mode, edge, args)
        record["trials"].append(trial)
        seconds = "" if trial["seconds"] is None else f" in {trial['seconds']:.1f}s"
        peak = "" if trial["peak_gib"] is None else f", peak {trial['peak_gib']:.2f} GiB"
        log(f"{mode}: edge {edge}: {'ok' if trial['ok'] else trial['error']}{seconds}{peak}")
        if not trial["ok"] and trial["error"] not in ("device OOM", "host memory"):
            results.data["errors"].append(f"{mode} edge {edge}: {trial['error']}")
        results.save()
        return trial["ok"]

    try:
        while True:  # grow
            if time.perf_counter() > deadline:
                record["stopped"] = "time budget"
                break
            if k * unit > args.max_edge:
                record["stopped"] = f"max edge {args.max_edge}"
                break
            if run(k):
                ok_k = k
                k = max(k + 1, int(round(k * 1.26)))
            else:
                fail_k = k
                break
        if fail_k is not None:
            record["stopped"] = "failure (bisected)"
            if ok_k is None:  # the starting edge failed: walk down
                while fail_k > 1 and ok_k is None and time.perf_counter() < deadline:
                    k = max(1, fail_k // 2)
                    if run(k):
                        ok_k = k
                    else:
                        fail_k = k
            while ok_k is not None and fail_k - ok_k > 1:
                if time.perf_counter() > deadline:
                    record["stopped"] = "time budget (bisection unfinished)"
                    break
                mid = (ok_k + fail_k) // 2
                if run(mid):
                    ok_k = mid
                else:
                    fail_k = mid
    except BudgetExceeded:
        record["stopped"] = "time budget (alarm)"
        raise
    finally:
        record["edge"] = ok_k * unit if ok_k is not None else None
        record["voxels"] = (ok_k * unit) ** 3 * args.batch if ok_k is not None else None
        record["first_failure"] = fail_k * unit if fail_k is not None else None
        results.save()
    return record


# ------------------------------------------------------------------------------------------------ timing
def time_steps(edge: int, args, bandwidth: dict | None) -> dict:
    model, wrapped = build_pair(edge, args, wrap=True)
    x, y = make_data(edge, args.batch)
    times = {"plain": [], "lms": []}
    peaks = {"plain": [], "lms": []}
    copied = []
    for step in range(args.warmup + args.steps):
        for mode, m in (("plain", model), ("lms", wrapped)):
            _sync()
            _reset_peak()
            before = lms_torch.transfer_stats()
            start = time.perf_counter()
            m.train_on_batch(x, y)
            _sync()
            seconds = time.perf_counter() - start
            after = lms_torch.transfer_stats()
            if step >= args.warmup:
                times[mode].append(seconds)
                peaks[mode].append(_peak_gib())
                if mode == "lms":
                    copied.append((after["d2h_bytes"] - before["d2h_bytes"], after["h2d_bytes"] - before["h2d_bytes"]))
    offloaded = wrapped.offloaded_bytes_per_step
    plain_s, lms_s = statistics.median(times["plain"]), statistics.median(times["lms"])
    d2h, h2d = (statistics.median(c[0] for c in copied), statistics.median(c[1] for c in copied))
    lower = transfer_s = None
    if bandwidth and bandwidth.get("h2d_gbps") and bandwidth.get("d2h_gbps"):
        transfer_s = offloaded / (bandwidth["d2h_gbps"] * 1e9) + offloaded / (bandwidth["h2d_gbps"] * 1e9)
        lower = max(plain_s, transfer_s)
    result = {
        "edge": edge,
        "voxels": edge ** 3 * args.batch,
        "plain_ms": plain_s * 1e3,
        "lms_ms": lms_s * 1e3,
        "plain_times_ms": [t * 1e3 for t in times["plain"]],
        "lms_times_ms": [t * 1e3 for t in times["lms"]],
        "plain_peak_gib": max(peaks["plain"]) if peaks["plain"] and peaks["plain"][0] is not None else None,
        "lms_peak_gib": max(peaks["lms"]) if peaks["lms"] and peaks["lms"][0] is not None else None,
        "offloaded_gib": offloaded / GIB,
        "d2h_gib": d2h / GIB,
        "h2d_gib": h2d / GIB,
        "offloaded_calls": sum(e.offloaded for e in wrapped.lms_plan),
        "calls": len(wrapped.lms_plan),
        "lower_bound_ms": None if lower is None else lower * 1e3,
        "transfer_ms": None if transfer_s is None else transfer_s * 1e3,
        "ratio_to_lower_bound": None if lower is None else lms_s / lower,
        "ratio_to_plain": lms_s / plain_s,
        "target_ratio_to_lower_bound": 1.10,
    }
    del model, wrapped, x, y
    _free()
    return result


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True, help="directory for results.json and results.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, runs on CPU (CI)")
    p.add_argument("--cap-gib", type=float, default=None, help="device memory cap (default 16; smoke: none)")
    p.add_argument("--budget-s", type=float, default=None, help="time budget in seconds (default 420; smoke: 240)")
    p.add_argument("--depth", type=int, default=None, help="U-Net depth (default 3; smoke: 2)")
    p.add_argument("--base-filters", type=int, default=None, help="U-Net base filters (default 16; smoke: 4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--start-edge", type=int, default=None, help="first edge of the ladder (default 64; smoke: 8)")
    p.add_argument("--max-edge", type=int, default=None, help="stop the ladder here (default 1024; smoke: 24)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 5; smoke: 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 2; smoke: 1)")
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--min-bytes", type=int, default=None, help="keras_lms.wrap min_bytes (default 1 MiB; smoke: 0)")
    p.add_argument("--simulate-oom-mvoxels", default=None, metavar="PLAIN,LMS",
                   help="CI only: treat steps above these Mvoxels as out of memory (exercises the bisection on CPU)")
    args = p.parse_args(argv)
    smoke = args.smoke
    limits = {}
    if args.simulate_oom_mvoxels:
        plain_limit, lms_limit = (float(v) for v in args.simulate_oom_mvoxels.split(","))
        limits = {"plain": plain_limit, "lms": lms_limit}
    args.simulate_oom_mvoxels = limits
    defaults = dict(cap_gib=None if smoke else 16.0, budget_s=240.0 if smoke else 420.0, depth=2 if smoke else 3,
                    base_filters=4 if smoke else 16, start_edge=8 if smoke else 64, max_edge=24 if smoke else 1024,
                    steps=2 if smoke else 5, warmup=1 if smoke else 2, min_bytes=0 if smoke else 1 << 20)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if keras.backend.backend() != "torch":
        print(f"benchmarks.gpu_bench needs KERAS_BACKEND=torch (got {keras.backend.backend()!r}).", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.smoke:
        print("No CUDA device: run with --smoke for the CPU code path.", file=sys.stderr)
        return 2
    if args.smoke and not torch.cuda.is_available():
        lms_torch.CPU_HOST_COPIES = True  # copy into host pool buffers even without a device (the code path)
    results = Results(args.out, args)
    results.save()
    deadline = T0 + args.budget_s

    def on_alarm(signum, frame):
        raise BudgetExceeded(f"time budget of {args.budget_s:.0f}s exceeded")

    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(args.budget_s) + 15)  # hard stop shortly after the soft deadline
    log(f"device {results.data['meta']['device']}, torch {torch.__version__}, keras {keras.__version__}, "
        f"budget {args.budget_s:.0f}s, cap {args.cap_gib} GiB")
    try:
        bw = measure_bandwidth(args.bandwidth_mib << 20, reps=5)
        results.data["bandwidth"] = bw
        results.save()
        log(f"bandwidth: {bw}")
        if torch.cuda.is_available() and args.cap_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, args.cap_gib * GIB / total)
            torch.cuda.set_per_process_memory_fraction(fraction, 0)
            results.data["meta"]["memory_fraction"] = fraction
        remaining = deadline - time.perf_counter()
        plain = largest_edge("plain", args, args.start_edge, time.perf_counter() + 0.35 * remaining, results)
        remaining = deadline - time.perf_counter()
        lms_start = plain["edge"] or args.start_edge
        lms = largest_edge("lms", args, lms_start, time.perf_counter() + 0.6 * remaining, results)
        if plain["voxels"] and lms["voxels"]:
            results.data["max_edge"]["voxel_ratio"] = lms["voxels"] / plain["voxels"]
        results.save()
        log(f"largest edge: plain {plain['edge']}, lms {lms['edge']}, voxel ratio "
            f"{_fmt(results.data['max_edge']['voxel_ratio'])}")
        unit = 2 ** args.depth
        top = plain["edge"] or args.start_edge
        # ~80% and ~50% of the plain model's largest volume: both fit both ways, with room for fragmentation
        sizes = {max(unit, int(round(top * f / unit)) * unit) for f in (0.93, 0.79)}
        for edge in sorted(sizes):
            if time.perf_counter() > deadline:
                results.data["errors"].append(f"timing at edge {edge} skipped: time budget")
                break
            log(f"timing at edge {edge}")
            try:
                t = time_steps(edge, args, bw)
            except BudgetExceeded:
                raise
            except Exception as err:
                kind = "device OOM" if _is_oom(err) else f"{type(err).__name__}: {str(err)[:300]}"
                results.data["errors"].append(f"timing at edge {edge}: {kind}")
                err = None
                _free()
                continue
            results.data["timing"].append(t)
            results.save()
            log(f"edge {edge}: plain {t['plain_ms']:.1f} ms, wrapped {t['lms_ms']:.1f} ms, lower bound "
                f"{_fmt(t['lower_bound_ms'], '.1f')} ms, wrapped/lower bound {_fmt(t['ratio_to_lower_bound'], '.3f')}")
        results.data["meta"]["complete"] = True
    except BudgetExceeded as err:
        results.data["errors"].append(str(err))
        log(str(err))
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
        results.data["meta"]["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        results.save()
        log(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
