"""GPU benchmark of keras-lms on the torch back end: transfer bandwidth, largest trainable 3D volume with and
without LMS under a device-memory cap, and step time against the transfer lower bound.

    KERAS_BACKEND=torch python -m benchmarks.gpu_bench --out runs/gpu            # one GPU, < 8 minutes
    KERAS_BACKEND=torch python -m benchmarks.gpu_bench --smoke --out /tmp/bench  # CPU, tiny sizes (CI)

Run it from the repository root (on a GPU machine: the repository carried there). Writes ``results.json`` and
``results.md`` under ``--out``, rewritten after every measurement, so an interrupted run still leaves what it
measured (``"complete": false``). Sections:

0. profile: ``keras-lms calibrate``'s measurement of this GPU (``keras_lms.calibrate.measure_profile``: copies
   alone and concurrent, element-wise bandwidth, Conv3D/Conv2D rates), written as ``profile.json`` too; the
   step-time predictions below use it.
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
   actually copied (beside the report's predicted bytes and step times on the calibrated profile); with the
   profile, also the time-aware plan ``wrap(model, device_profile=...)`` (``--timed-profile``, default the
   calibrated one: the activations it recomputes instead of copying), its bytes, recomputes and prediction; and the
   lower bound ``max(plain step, offloaded/BW_d2h + offloaded/BW_h2d)`` (each

Imports only keras (torch back end), torch, numpy, keras_lms and benchmarks/ (models.py, gpu_bench_measure.py:
the measurements, gpu_bench_report.py: the results files; no TensorFlow).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch

from keras_lms.offload import torch as lms_torch

try:
    from benchmarks.gpu_bench_measure import BudgetExceeded, _free, _is_oom, largest_edge, measure_bandwidth, time_steps
    from benchmarks.gpu_bench_report import GIB, T0, Results, _fmt, log
except ModuleNotFoundError as err:  # run as a file: the repository root is not on sys.path
    if err.name != "benchmarks":
        raise
    raise SystemExit("run it from the repository root as a module: python -m benchmarks.gpu_bench ...") from err


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
    p.add_argument("--timed-profile", default=None, metavar="PROFILE",
                   help="device profile the time-aware plan is made for (a built-in name or a JSON file; default: "
                        "the profile calibrated in this run). Its prediction is always on the calibrated one")
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
        from keras_lms.calibrate import measure_profile

        profile = measure_profile("cuda" if torch.cuda.is_available() else "cpu", smoke=args.smoke)
        profile.save(args.out / "profile.json")
        results.data["profile"] = profile.to_dict()
        results.save()
        log(f"profile: h2d {profile.host_to_device_bytes_per_second / 1e9:.1f} GB/s, d2h "
            f"{profile.device_to_host_bytes_per_second / 1e9:.1f} GB/s, conv "
            + ", ".join(f"{d} {r / 1e12:.1f} TFLOP/s" for d, r in profile.flops_per_second.items()))
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
                t = time_steps(edge, args, bw, profile)
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
            log(f"edge {edge}: plain {t['plain_ms']:.1f} ms (predicted {t['predicted_plain_ms']:.1f}), wrapped "
                f"{t['lms_ms']:.1f} ms (predicted {t['predicted_lms_ms']:.1f}), lower bound "
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
