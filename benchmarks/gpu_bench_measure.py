"""The measurements of benchmarks/gpu_bench.py: transfer bandwidth, largest trainable cube, step timing.

* :func:`measure_bandwidth` -- pinned host->device, device->host (on a side stream) and device->device GB/s.
* :func:`try_step` / :func:`largest_edge` -- one training step of the 3D U-Net (plain or ``keras_lms.wrap``-ed)
  at a cube edge, ok or the kind of failure; the edge ladder (~2x voxels per rung) and the bisection.
* :func:`time_steps` -- median step time plain vs wrapped at one edge, peak memory, offloaded and copied bytes,
  and the transfer lower bound.

Each trial frees the models and torch's device and pinned-host caches before and after, so trials do not see
each other's memory. :class:`BudgetExceeded` (raised by the run's alarm) passes through every trial.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch

import keras_lms
from benchmarks.gpu_bench_report import GIB, Results, log
from benchmarks.models import build_unet
from keras_lms.offload import torch as lms_torch


class BudgetExceeded(Exception):
    """The run's time budget is spent (raised by the alarm between trials or inside a long one)."""


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


def wrap_time_aware(model, min_bytes: int, profile):
    """The time-aware plan of ``model`` for ``profile`` (name, file or DeviceProfile), compiled as ``build_pair``'s."""
    timed = keras_lms.wrap(model, min_bytes=min_bytes, device_profile=profile)
    timed.compile(optimizer=keras.optimizers.SGD(1e-3), loss="binary_crossentropy")
    return timed


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
def predicted_times(wrapped, batch: int, profile) -> dict:
    """keras_lms.report's prediction for the wrapped model on ``profile`` (the profile calibrated in this run):
    step times of the plain step and the plan, and the plan's bytes each way."""
    rep = keras_lms.report(wrapped, batch_size=batch, device_profile=profile)
    planned, plain = rep.times["as planned"], rep.times["plain"]
    return {"predicted_plain_ms": plain.step_seconds * 1e3, "predicted_lms_ms": planned.step_seconds * 1e3,
            "predicted_exposed_ms": planned.exposed_seconds * 1e3,
            "predicted_d2h_gib": planned.device_to_host_bytes / GIB,
            "predicted_h2d_gib": planned.host_to_device_bytes / GIB}


def _recomputed(wrapped) -> list:
    """The calls whose outputs the wrapped model's last traced plan recomputes instead of copying."""
    return [e.index for e in wrapped.lms_plan if e.recomputed_output]


def time_steps(edge: int, args, bandwidth: dict | None, profile=None) -> dict:
    """Median step times at ``edge``: plain, wrapped with the defaults (offload-only) and, with ``profile`` (the
    one calibrated in this run), the time-aware plan ``wrap(model, device_profile=...)`` made for
    ``args.timed_profile`` or ``profile`` (what it recomputes instead of copying), steps alternating on the same
    weights, with the bytes each copied and the report's predictions on ``profile`` beside them."""
    model, wrapped = build_pair(edge, args, wrap=True)
    modes = [("plain", model), ("lms", wrapped)]
    timed = None
    if profile is not None:
        timed = wrap_time_aware(model, args.min_bytes, getattr(args, "timed_profile", None) or profile)
        modes.append(("timed", timed))
    x, y = make_data(edge, args.batch)
    times = {mode: [] for mode, _ in modes}
    peaks = {mode: [] for mode, _ in modes}
    copies = {mode: [] for mode, _ in modes}
    for step in range(args.warmup + args.steps):
        for mode, m in modes:
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
                copies[mode].append({k: after[k] - before[k] for k in ("d2h_bytes", "h2d_bytes", "recomputed_outputs")})
    copied = [(c["d2h_bytes"], c["h2d_bytes"]) for c in copies["lms"]]
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
    if profile is not None:
        result.update(predicted_times(wrapped, args.batch, profile))
        timed_s = statistics.median(times["timed"])
        predicted = predicted_times(timed, args.batch, profile)
        result.update({
            "timed_ms": timed_s * 1e3,
            "timed_times_ms": [t * 1e3 for t in times["timed"]],
            "timed_peak_gib": max(peaks["timed"]) if peaks["timed"][0] is not None else None,
            "timed_d2h_gib": statistics.median(c["d2h_bytes"] for c in copies["timed"]) / GIB,
            "timed_h2d_gib": statistics.median(c["h2d_bytes"] for c in copies["timed"]) / GIB,
            "timed_recomputed": statistics.median(c["recomputed_outputs"] for c in copies["timed"]),
            "timed_recomputed_planned": len(_recomputed(timed)),
            "timed_ratio_to_plain": timed_s / plain_s,
            "timed_ratio_to_lms": timed_s / lms_s,
            "predicted_timed_ms": predicted["predicted_lms_ms"],
            "predicted_timed_d2h_gib": predicted["predicted_d2h_gib"],
            "predicted_timed_h2d_gib": predicted["predicted_h2d_gib"],
        })
    del model, wrapped, timed, x, y
    _free()
    return result

