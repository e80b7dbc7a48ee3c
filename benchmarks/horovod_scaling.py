"""Data-parallel scaling of keras_lms.horovod on CPU: samples/s with 1 rank vs N ranks (ideal ratio N).

    .venv/bin/python benchmarks/horovod_scaling.py                # 1 vs 2 ranks, Gloo, plain + LMS-wrapped
    .venv/bin/python benchmarks/horovod_scaling.py --launcher mpi --steps 60

The script launches both configurations itself (``horovodrun -np 1`` and ``horovodrun -np N``, or mpirun) and
prints one table. Each rank is limited to exactly one core: TensorFlow intra/inter-op threads = 1 and
``os.sched_setaffinity`` to core ``local_rank``, so N ranks use N cores and the ideal ratio is N.
A third run starts the same N pinned processes *without* any gradient exchange (plain optimizer): its ratio is
the ceiling the cores allow (on VMs two vCPUs often do not give 2x compute), shown next to the ideal.
Throughput = ranks x batch x steps / wall time of the timed ``fit`` (after a warm-up fit that traces the step),
measured on rank 0 between two barriers. Weak scaling: the per-rank batch is fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- worker
def _local_rank_from_env() -> int:
    for var in ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def worker(args) -> None:
    # Pin before TensorFlow or Horovod start any thread: sched_setaffinity(0, ...) applies to the calling
    # thread and the threads it creates later, not to threads that already exist.
    cores = sorted(os.sched_getaffinity(0))
    core = cores[_local_rank_from_env() % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import keras_lms.horovod as lhvd

    lhvd.init(cpu_threads=None)  # threads set above
    assert _local_rank_from_env() == lhvd.local_rank() or lhvd.size() == 1
    import horovod.tensorflow as hvd

    barrier_id = [0]

    def barrier():
        barrier_id[0] += 1
        hvd.allreduce(tf.constant(0.0), name=f"bench_barrier_{barrier_id[0]}")

    def make_model():
        keras.utils.set_random_seed(0)
        s = args.image_size
        inp = keras.Input((s, s, 3))
        h = inp
        for filters in (32, 64):
            h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(inp, keras.layers.Dense(10)(h))

    rng = np.random.default_rng(lhvd.rank())
    n = args.batch_size * args.steps
    x = rng.normal(size=(n, args.image_size, args.image_size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    variants = [("plain", False)]
    if not args.no_wrap:
        try:
            import keras_lms

            keras_lms.wrap  # noqa: B018
            variants.append(("lms-wrapped", True))
        except Exception as exc:  # pragma: no cover
            print(f"keras_lms.wrap unavailable, skipping the wrapped variant: {exc}", file=sys.stderr)
    results = []
    for name, wrap in variants:
        model = make_model()
        if wrap:
            import keras_lms

            model = keras_lms.wrap(model, min_bytes=0)
        opt = keras.optimizers.SGD(0.01 * lhvd.size(), momentum=0.9)
        if not args.independent:
            opt = lhvd.DistributedOptimizer(opt)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        cbs = [] if args.independent else [lhvd.BroadcastGlobalVariablesCallback(0)]
        wx, wy = x[: args.batch_size * args.warmup], y[: args.batch_size * args.warmup]
        model.fit(wx, wy, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=cbs)
        times = []
        for _ in range(args.repeats):  # best of N: robust against other load on the machine
            barrier()
            t0 = time.perf_counter()
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
            barrier()
            times.append(time.perf_counter() - t0)
        secs = min(times)
        results.append({"variant": name, "ranks": lhvd.size(), "seconds": secs, "all_seconds": times,
                        "samples_per_s": lhvd.size() * n / secs})
    if lhvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"results": results, "core": core}))


# ------------------------------------------------------------------------------------------------- driver
def launch(np_: int, args, out: Path, independent: bool = False) -> None:
    py = sys.executable
    me = str(Path(__file__).resolve())
    wargs = [me, "--worker-out", str(out), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--image-size", str(args.image_size)] \
            + (["--no-wrap"] if args.no_wrap else []) \
        + (["--independent"] if independent else [])
    if args.launcher == "gloo":
        cmd = [str(Path(py).parent / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", py, *wargs]
    else:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        cmd = [shutil.which("mpirun") or "mpirun", *root, "--oversubscribe", "--bind-to", "none", "-np", str(np_),
               py, *wargs]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{np_}-rank run failed (exit {proc.returncode})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks of the parallel run (default 2; needs that many cores)")
    p.add_argument("--launcher", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch")
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed fits per configuration; the fastest counts")
    p.add_argument("--no-wrap", action="store_true", help="skip the keras_lms.wrap variant")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the run without allreduce that measures what the cores themselves allow")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_out:
        return worker(args)

    ncpu = len(os.sched_getaffinity(0))
    if ncpu < args.np:
        print(f"warning: {args.np} ranks but only {ncpu} cores available; ranks will share cores", file=sys.stderr)
    t_start = time.time()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average {load_before:.2f} before start: other processes compete for the cores and "
              "the ratios below will be lower than what the cores allow", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for np_ in (1, args.np):
            out = Path(tmp) / f"np{np_}.json"
            launch(np_, args, out)
            runs[np_] = json.loads(out.read_text())["results"]
        if not args.no_ceiling:
            # Same N processes, same pinning, plain optimizer: no gradient exchange at all. Their combined
            # throughput is the most N ranks can reach on these cores (shared caches, memory bandwidth,
            # SMT siblings, turbo), the honest yardstick next to the ideal N.
            out = Path(tmp) / "ceiling.json"
            launch(args.np, args, out, independent=True)
            runs["ceiling"] = json.loads(out.read_text())["results"]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"keras_lms.horovod CPU scaling ({args.launcher}, 1 core per rank, per-rank batch "
                        f"{args.batch_size}, {args.steps} steps, {args.image_size}x{args.image_size} CNN)")
    for col in ("model", "ranks", "samples/s", "ratio", "ideal", "ceiling*", "efficiency"):
        table.add_column(col, justify="right" if col != "model" else "left", no_wrap=True)
    table.caption = ("ratio = samples/s vs 1 rank; ceiling* = ratio of the same ranks without allreduce; "
                     "efficiency = ratio / ideal (ratio / ceiling)")
    summary = []
    ceilings = runs.get("ceiling") or [None] * len(runs[1])
    for one, many, ceil in zip(runs[1], runs[args.np], ceilings):
        ratio = many["samples_per_s"] / one["samples_per_s"]
        cratio = ceil["samples_per_s"] / one["samples_per_s"] if ceil else None
        table.add_row(one["variant"], "1", f"{one['samples_per_s']:.1f}", "1.00", "1.0", "", "")
        table.add_row(many["variant"], str(args.np), f"{many['samples_per_s']:.1f}", f"{ratio:.2f}",
                      f"{float(args.np):.1f}", f"{cratio:.2f}" if cratio else "-",
                      f"{100 * ratio / args.np:.0f}%" + (f" ({100 * ratio / cratio:.0f}%)" if cratio else ""))
        summary.append({"variant": one["variant"], "samples_per_s_1": one["samples_per_s"],
                        f"samples_per_s_{args.np}": many["samples_per_s"], "ratio": ratio, "ideal": args.np,
                        "ceiling_ratio_no_allreduce": cratio})
    Console().print(table)
    print(json.dumps({"summary": summary, "total_seconds": round(time.time() - t_start, 1),
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
