"""Where a training step's GPU time goes, per plan: a ``torch.profiler`` kernel breakdown on the torch back end.

    KERAS_BACKEND=torch python -m benchmarks.gpu_step_profile --edge 192 --profile runs/gpu/profile.json --out runs/prof
    KERAS_BACKEND=torch python -m benchmarks.gpu_step_profile --smoke --out /tmp/prof     # CPU, tiny (code path only)

Why: the step-time model predicted the H200's plain and wrapped U-Net steps about 2x low (docs/benchmarks.md), with
the bytes exact, so its compute side is what is off. This times plain, offload-only (``wrap`` defaults) and the
time-aware plan (``wrap(model, device_profile=...)``) at one edge and sums the device time of the profiled steps by
kernel class (convolution, layout copies, element-wise, reductions, normalisation, host copies), with the busy time
of compute kernels beside the wall time: what the model must count. Writes ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch

from benchmarks.gpu_bench_measure import _free, _sync, build_pair, make_data, wrap_time_aware
from keras_lms.offload import torch as lms_torch

CLASSES = (  # first match wins, on the lower-cased kernel name
    ("host->device copy", ("memcpy htod",)),
    ("device->host copy", ("memcpy dtoh",)),
    ("layout (cuDNN)", ("nchwtonhwc", "nhwctonchw", "transpose")),
    ("convolution", ("conv", "cudnn", "xmma", "implicit", "wgrad", "dgrad", "fprop", "cutlass", "gemm")),
    ("copies (permute/contiguous)", ("copy",)),
    ("normalization", ("batch_norm", "batchnorm", "welford")),
    ("reductions", ("reduce",)),
    ("element-wise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def _union_seconds(intervals) -> float:
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


def breakdown(trace: dict, steps: int) -> dict:
    """Per-step device seconds by kernel class, compute busy time and copy busy time, from a chrome trace."""
    by_class = collections.Counter()
    compute, copies = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        label = kernel_class(ev.get("name", ""))
        by_class[label] += ev["dur"] / 1e6
        (copies if label.endswith("copy") and ev["cat"] == "gpu_memcpy" else compute).append(
            (ev["ts"], ev["ts"] + ev["dur"]))
    return {"by_class_s": {k: v / steps for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "compute_busy_s": _union_seconds(compute) / steps, "copy_busy_s": _union_seconds(copies) / steps}


def profile_mode(model, x, y, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        model.train_on_batch(x, y)
    _sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            model.train_on_batch(x, y)
        _sync()
        wall = (time.perf_counter() - start) / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return {"wall_s": wall, **breakdown(trace, steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the code path; no device kernels)")
    p.add_argument("--edge", type=int, default=None, help="cube edge (default 192; smoke 16)")
    p.add_argument("--depth", type=int, default=None, help="U-Net depth (default 3; smoke 2)")
    p.add_argument("--base-filters", type=int, default=None, help="default 16; smoke 4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--profile", default=None, help="device profile of the time-aware plan (name or JSON file)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    args.edge = args.edge or (16 if args.smoke else 192)
    args.depth = args.depth or (2 if args.smoke else 3)
    args.base_filters = args.base_filters or (4 if args.smoke else 16)
    args.min_bytes = 0 if args.smoke else 1 << 20
    if keras.backend.backend() != "torch":
        raise SystemExit("benchmarks.gpu_step_profile needs KERAS_BACKEND=torch")
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("No CUDA device: run with --smoke for the CPU code path.")
    if args.smoke and not torch.cuda.is_available():
        lms_torch.CPU_HOST_COPIES = True  # copy into host pool buffers even without a device, as gpu_bench --smoke
    args.out.mkdir(parents=True, exist_ok=True)
    model, wrapped = build_pair(args.edge, args, wrap=True)
    modes = {"plain": model, "offload-only": wrapped}
    if args.profile:
        modes["time-aware"] = wrap_time_aware(model, args.min_bytes, args.profile)
    x, y = make_data(args.edge, args.batch)
    results = {"edge": args.edge, "depth": args.depth, "base_filters": args.base_filters, "batch": args.batch,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "keras": keras.__version__, "modes": {}}
    for mode, m in modes.items():
        results["modes"][mode] = profile_mode(m, x, y, args.warmup, args.steps)
        (args.out / "summary.json").write_text(json.dumps(results, indent=1))
        print(mode, json.dumps(results["modes"][mode]), flush=True)
    classes = sorted({c for r in results["modes"].values() for c in r["by_class_s"]})
    lines = [f"# Step breakdown at {args.edge}^3 ({results['device']}), ms per step", "",
             "| class | " + " | ".join(results["modes"]) + " |", "|---|" + "---|" * len(results["modes"])]
    rows = [("wall", "wall_s"), ("compute kernels busy", "compute_busy_s"), ("host copies busy", "copy_busy_s")]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(f"{r[key] * 1e3:.1f}" for r in results["modes"].values()) + " |")
    for c in classes:
        lines.append(f"| {c} | " + " | ".join(f"{r['by_class_s'].get(c, 0) * 1e3:.1f}"
                                            for r in results["modes"].values()) + " |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    del modes, model, wrapped
    _free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
