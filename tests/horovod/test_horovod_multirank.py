"""Multi-process tests of keras_lms.horovod with real Horovod launches (Gloo and MPI controllers).

Each launch runs tests/horovod/_worker.py on 2 ranks (plus one plain single-process run), which executes all
scenarios in one TensorFlow start-up and writes one JSON file per rank; the tests below assert on those files.
Per launch: CUDA hidden, one TF/OMP thread per rank, a hard timeout (the process group is killed on expiry).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.horovod

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
WORKER = HERE / "_worker.py"
FAULT_WORKER = HERE / "_fault_worker.py"
# Horovod's horovodrun, less the build check that imports TensorFlow before every launch (see the script).
HOROVODRUN = [sys.executable, str(HERE / "_horovodrun.py")]
LAUNCH_TIMEOUT = 240  # seconds per 2-rank launch; the worker needs ~20 s on 2 cores
TOL = 1e-5


# ------------------------------------------------------------------------------------------ environment
@functools.lru_cache(maxsize=None)
def horovod_build() -> dict | str:
    """{'mpi': bool, 'gloo': bool} of the installed Horovod, or a skip reason."""
    if not (BIN / "horovodrun").exists():
        return (f"Horovod is not installed in {BIN} (run `make install` or "
                f"`bash scripts/install_horovod.sh {sys.executable}`)")
    code = "import horovod.tensorflow as h; print(int(h.mpi_built()), int(h.gloo_built()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=rank_env(),
                          timeout=120)
    if proc.returncode != 0:
        return "horovod.tensorflow is not importable: " + proc.stderr.strip().splitlines()[-1][-300:]
    mpi, gloo = proc.stdout.split()[-2:]
    return {"mpi": mpi == "1", "gloo": gloo == "1"}


def rank_env() -> dict:
    env = dict(os.environ)
    env.update({
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "TF_NUM_INTRAOP_THREADS": "1",
        "TF_NUM_INTEROP_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
        "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def launcher_command(kind: str, script: Path, outdir: Path) -> list[str]:
    if kind == "gloo":
        return [*HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script), str(outdir)]
    if kind == "mpi":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        # No core binding and yielding waits: on a 2-core machine that also runs other work, OpenMPI's default
        # (bind each rank to a core, busy-poll) made this launch 5x slower.
        return [shutil.which("mpirun"), *root, "--oversubscribe", "--bind-to", "none", "--mca",
                "mpi_yield_when_idle", "1", "-np", "2", sys.executable, str(script), str(outdir)]
    if kind == "single":
        return [sys.executable, str(script), str(outdir)]
    raise ValueError(kind)


def skip_unless_available(kind: str) -> None:
    build = horovod_build()
    if isinstance(build, str):
        pytest.skip(build)
    if kind == "gloo" and not build["gloo"]:
        pytest.skip("Horovod built without Gloo")
    if kind == "mpi":
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun not found (apt-get install openmpi-bin libopenmpi-dev, then rerun install_horovod.sh)")
        if not build["mpi"]:
            pytest.skip("Horovod built without MPI (rerun scripts/install_horovod.sh after installing OpenMPI)")


def launch(kind: str, script: Path, outdir: Path, timeout: float, env: dict | None = None
           ) -> tuple[int | None, str, float]:
    """Run a launcher in its own process group; on timeout kill the group. Returns (rc or None, output, s)."""
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(launcher_command(kind, script, outdir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**rank_env(), **(env or {})}, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return rc, out, time.monotonic() - t0


def tail(text: str, n: int = 60) -> str:
    lines = [ln for ln in text.splitlines() if "I0000" not in ln and "All log messages before" not in ln]
    return "\n".join(lines[-n:])


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", params=["gloo", "mpi", "single"])
def run(request, tmp_path_factory):
    """Per-rank results of one worker launch (2 ranks under Gloo / MPI, or one plain process)."""
    kind = request.param
    skip_unless_available(kind)
    outdir = tmp_path_factory.mktemp(f"hvd_{kind}")
    rc, out, secs = launch(kind, WORKER, outdir, LAUNCH_TIMEOUT)
    assert rc is not None, f"{kind} launch timed out after {LAUNCH_TIMEOUT}s:\n{tail(out)}"
    assert rc == 0, f"{kind} launch failed with exit code {rc}:\n{tail(out)}"
    size = 1 if kind == "single" else 2
    ranks = []
    for r in range(size):
        path = outdir / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results:\n{tail(out)}"
        ranks.append(json.loads(path.read_text()))
    return {"kind": kind, "size": size, "ranks": ranks, "seconds": secs, "output": out}


def scenario(run, name: str) -> list[dict]:
    """The scenario's result on every rank; fails with the worker's traceback if it raised."""
    errors = {r["rank"]: r["errors"][name] for r in run["ranks"] if name in r["errors"]}
    if errors:
        pytest.fail(f"scenario {name!r} raised in the worker ({run['kind']}):\n" +
                    "\n".join(f"rank {k}: {v}" for k, v in errors.items()))
    return [r[name] for r in run["ranks"]]


def need_two_ranks(run):
    if run["size"] < 2:
        pytest.skip("needs 2 ranks")


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


# ------------------------------------------------------------------------------------------ tests
def test_all_scenarios_ran(run):
    for r in run["ranks"]:
        assert r["size"] == run["size"]
        assert not r["errors"], f"rank {r['rank']} scenario errors: {sorted(r['errors'])}\n" + "\n".join(
            r["errors"].values())


def test_init_info(run):
    import psutil

    infos = [r["info"] for r in run["ranks"]]
    assert [i["rank"] for i in infos] == list(range(run["size"]))
    for i in infos:
        assert i["size"] == run["size"] and i["local_size"] == run["size"]
        assert i["gpu"] is None  # CUDA hidden
        if run["kind"] != "single":
            assert i["controller"] == run["kind"]
        expected = int(psutil.virtual_memory().total / 2**20 * 0.8 / run["size"])
        assert i["env_set"]["TF_GPU_HOST_MEM_LIMIT_IN_MB"] == str(expected)
        assert i["host_mem_limit_mb"] == expected
        assert i["cpu_threads"] is None  # TF_NUM_INTRAOP_THREADS is set by the launcher: left alone


def test_two_ranks_match_one_rank_with_global_batch(run):
    res = scenario(run, "equivalence")
    for r in res:
        assert maxdiff(r["final"], r["reference"]) < TOL
        assert r["iterations"] == 3 * 64 // (8 * run["size"])


def test_weights_identical_across_ranks_after_every_epoch(run):
    need_two_ranks(run)
    res = scenario(run, "equivalence")
    assert len(res[0]["epoch_digests"]) == 3
    assert res[0]["epoch_digests"] == res[1]["epoch_digests"]


def test_backward_passes_per_step(run):
    """Explicit mean + per-update counting, and Horovod's defaults: the sum, and `iterations` counting every
    pass (issue 12: Horovod counts 1..N per pass; we counted applied updates only)."""
    res = scenario(run, "backward_passes")
    for r in res:
        for label in ("mean_per_update", "defaults"):
            assert maxdiff(r[label]["final"], r["reference"]) < TOL, label
            assert r[label]["n_optimizer_variables"] == 6  # iterations, lr, 4 momentums: accumulators untracked
        assert r["mean_per_update"]["iterations"] == r["updates"]
        assert r["defaults"]["iterations"] == r["passes"]
    assert all(r["defaults"]["final"] == res[0]["defaults"]["final"] for r in res)


def test_other_optimizers(run):
    for r in scenario(run, "other_optimizers"):
        for label, res in r.items():
            assert res["distributed"], label
            assert maxdiff(res["final"], res["reference"]) < TOL, label
        assert r["adam"]["class"] == "Adam" and r["loss_scale_sgd"]["class"] == "LossScaleOptimizer"


def test_rank_helpers(run):
    for r, h in zip(run["ranks"], scenario(run, "helpers")):
        root = r["rank"] == 0
        assert h["rank0_only"] == (["ckpt", "csv"] if root else [])
        assert h["fit_verbose"] == (1 if root else 0)
        assert h["is_root"] == root and h["info_rank"] == r["rank"]
        assert h["ranks"] == [run["size"], r["rank"], r["rank"], run["size"]]


def test_custom_loops_with_sparse_gradients(run):
    res = scenario(run, "custom_loop_sparse")
    for r in res:
        for label in ("graph_sparse", "graph_dense", "eager_sparse"):
            assert r[label + "_grad_types"][0] == "IndexedSlices"  # the Embedding gradient really is sparse
            assert maxdiff(r[label], r["reference"]) < TOL, label
    for label in ("graph_sparse", "graph_dense", "eager_sparse"):
        assert all(r[label] == res[0][label] for r in res)


def test_fp16_compression_close_to_reference(run):
    for r in scenario(run, "fp16_compression"):
        assert maxdiff(r["final"], r["reference"]) < 2e-3


def test_metric_average(run):
    need_two_ranks(run)
    res = scenario(run, "metric_average")
    for epoch in range(2):
        raws = [r["raw"][epoch] for r in res]
        assert set(raws[0]) == {"loss", "mae", "val_loss", "val_mae"}
        assert raws[0]["loss"] != pytest.approx(raws[1]["loss"], rel=1e-3)  # ranks really differ
        for key in raws[0]:
            mean = sum(x[key] for x in raws) / len(raws)
            for r in res:
                assert r["averaged"][epoch][key] == pytest.approx(mean, rel=1e-6), key
                assert r["history"][key][epoch] == pytest.approx(mean, rel=1e-6), key


def test_broadcast_makes_ranks_equal(run):
    need_two_ranks(run)
    res = scenario(run, "broadcast")
    assert res[0]["before"] != res[1]["before"]  # different initialisation
    assert res[1]["after_broadcast"] == res[0]["root_initial"] == res[0]["after_broadcast"]
    assert res[0]["final"] == res[1]["final"]
    # optimizer slots too: rank 1 set 0.002, rank 0 set 0.001 -> 0.001 everywhere
    for r in res:
        assert r["momentum_after_broadcast"]
        assert all(m == pytest.approx(0.001) for m in r["momentum_after_broadcast"])


def test_lr_warmup_formula_and_momentum_correction(run):
    size = run["size"]
    for r in scenario(run, "warmup"):
        spe, warmup, initial = r["steps_per_epoch"], 2, 0.2
        last = None
        for epoch, batch, lr in r["lr"]:
            if epoch < warmup:
                e = epoch + batch / spe + 1 / spe
                expected = initial / size * (e * (size - 1) / warmup + 1)
            else:
                expected = last  # unchanged after warm-up
            assert lr == pytest.approx(expected, rel=1e-6), (epoch, batch)
            last = expected
        assert r["lr"][warmup * spe - 1][2] == pytest.approx(initial)
        assert r["history_lr"][-1] == pytest.approx(initial)
        # Momentum correction: buffers are rescaled by lr_new/lr_old before each batch.
        lrs = [x[2] for x in r["lr"]]
        for k in range(1, len(lrs)):
            if r["mom_end"][k - 1] > 0:
                assert r["mom_begin"][k] / r["mom_end"][k - 1] == pytest.approx(lrs[k] / lrs[k - 1], rel=1e-4)


def test_lr_schedule_callback(run):
    for r in scenario(run, "schedule"):
        first = {e: lr for e, b, lr in r["lr"] if b == 0}
        assert first == {0: pytest.approx(0.1), 1: pytest.approx(0.1), 2: pytest.approx(0.05)}
        # An optimizer with a LearningRateSchedule cannot be driven by the LR callbacks: clear error.
        assert r["schedule_error"] is not None
        assert "float learning_rate" in r["schedule_error"] and "ExponentialDecay" in r["schedule_error"]


def test_negative_control_plain_optimizer_diverges(run):
    need_two_ranks(run)
    res = scenario(run, "negative_control")
    assert all(a != b for a, b in zip(res[0]["epoch_digests"], res[1]["epoch_digests"]))
    assert maxdiff(res[0]["final"], res[1]["final"]) > 1e-3


def test_lms_wrapped_model_unchanged(run):
    res = scenario(run, "wrapped")
    if "skipped" in res[0]:
        pytest.skip(res[0]["skipped"])
    plain = scenario(run, "equivalence")
    for r, p in zip(res, plain):
        assert r["type"] == "LMSModel"
        assert r["offloaded_calls"] is None or r["offloaded_calls"] >= 1
        assert maxdiff(r["final"], r["reference"]) < TOL
        assert maxdiff(r["final"], p["final"]) < TOL
    assert all(r["epoch_digests"] == res[0]["epoch_digests"] for r in res)
    if run["size"] == 2:  # broadcast reaches the wrapped model's weights
        assert res[0]["bcast_before"] != res[1]["bcast_before"]
        assert res[0]["bcast_after"] == res[1]["bcast_after"] == res[0]["bcast_before"]
        assert res[0]["bcast_final"] == res[1]["bcast_final"]


def test_xla_gives_clear_error(run):
    need_two_ranks(run)
    for r in scenario(run, "xla_error"):
        assert r["error"] and "jit_compile=False" in r["error"]


def test_backup_and_restore_per_rank(run):
    """keras_lms.callbacks.BackupAndRestore under keras_lms.horovod: each rank writes backup/rank-<r>, and a run
    resumed from them ends with the weights of an uninterrupted run on every rank (Dropout included)."""
    results = scenario(run, "backup_and_restore")
    for r in results:
        assert r["epochs_run_after_resume"] == 1, r  # it resumed (a fresh start would run 3 epochs)
        assert r["resumed"] == r["uninterrupted"], r
        assert r["iterations"] == 3 * (64 // (run["size"] * 8)), r
    assert len({r["resumed"] for r in results}) == 1
    expected = [f"rank-{i}" for i in range(run["size"])] if run["size"] > 1 else []
    assert results[0]["rank_dirs"] == expected, results[0]


def test_saving_and_config(run):
    r = scenario(run, "saving")[0]
    assert r["is_sgd"]
    assert r["config"] == r["inner_config"]
    assert sorted(r["config"]) == r["plain_sgd_config_keys"]
    assert r["serialized"]["module"] == "keras.optimizers" and r["serialized"]["class_name"] == "SGD"
    assert r["plain_loaded"] == ["SGD", False]
    assert r["rewrapped"] == ["SGD", True]
    assert r["rewrapped_iterations"] == 7 and r["rewrapped_momentum"] == [0.25]
    assert r["weights_equal"]


@pytest.mark.parametrize("kind", ["gloo", "mpi"])
def test_failing_rank_ends_job_quickly(kind, tmp_path):
    skip_unless_available(kind)
    rc, out, secs = launch(kind, FAULT_WORKER, tmp_path, timeout=90)
    assert rc is not None, f"job hung: killed after 90 s\n{tail(out)}"
    assert (tmp_path / "started0").exists() and (tmp_path / "started1").exists(), tail(out)
    assert not (tmp_path / "finished1").exists()
    assert rc != 0
    assert "injected failure on rank 1" in out
    assert secs < 60, f"took {secs:.1f}s"


STEPS_WORKER = HERE / "_steps_worker.py"


@pytest.fixture(scope="module")
def steps_job(tmp_path_factory):
    """One gloo launch of _steps_worker.py: 8 vs 6 batches per epoch from arrays (known), then generators (unknown)."""
    skip_unless_available("gloo")
    outdir = tmp_path_factory.mktemp("steps")
    started = time.time()
    rc, out, secs = launch("gloo", STEPS_WORKER, outdir, timeout=210)
    assert rc is not None, f"the job hung ({secs:.0f} s) with different batch counts per rank:\n{tail(out)}"
    return {"dir": outdir, "rc": rc, "out": out, "started": started, "ended": time.time()}


def test_different_batch_counts_fail_fast_on_every_rank(steps_job):
    """8 vs 6 batches per epoch (arrays): every rank raises at train begin naming the sharding (was: a hang)."""
    known, out = steps_job["dir"] / "known", steps_job["out"]
    for r in range(2):
        assert (known / f"started{r}").exists(), tail(out)
        assert not (known / f"epoch_end{r}").exists(), "must fail before training, not after an epoch"
        assert (known / f"error{r}").exists(), f"rank {r} did not fail:\n{tail(out)}"
        err = (known / f"error{r}").read_text()
        assert err.startswith("ValueError") and "rank 0: 8, rank 1: 6" in err and "shard" in err, err
        secs = float((known / f"failed_at{r}").read_text()) - steps_job["started"]
        assert secs < 60, f"rank {r} failed {secs:.1f} s after the launch"


def test_unknown_batch_counts_fail_at_the_first_epoch_end(steps_job):
    """Generators (steps unknown up front), 8 vs 6 batches: the rank whose epoch ends first sends an
    end-of-epoch marker that pairs with the other rank's gradient allreduce; both raise, naming the sharding,
    within 60 s of the divergence (was: a hang)."""
    unknown, out = steps_job["dir"] / "unknown", steps_job["out"]
    assert steps_job["rc"] != 0, tail(out)
    diverged = float((unknown / "epoch_end1").read_text())  # rank 1 ran out of data first
    assert not (unknown / "epoch_end0").exists()
    end = steps_job["ended"]
    assert end - diverged < 60, f"the job ended {end - diverged:.0f} s after the ranks diverged"
    for r in range(2):
        assert not (unknown / f"finished{r}").exists()
        assert (unknown / f"error{r}").exists(), f"rank {r} did not fail:\n{tail(out)}"
        err = (unknown / f"error{r}").read_text()
        assert "different numbers of training batches" in err and "shard" in err, err[:3000]


# ------------------------------------------------------------------- issue 11 item 7, issue 12 item 3
def test_memory_callback_inside_rank0_only_does_not_hang(run):
    """MemoryHighWaterMark runs no collective unless across_ranks=True (it hid an allgather that only rank 0
    reached: the whole launch hung); rank0_only refuses a collective callback on every rank."""
    res = scenario(run, "memory_callback_placement")
    for r, m in zip(run["ranks"], res):
        if r["rank"] == 0:
            assert {"peak_device_mib", "peak_host_rss_mib", "offloaded_mib"} <= set(m["rank0_only_keys"])
        else:
            assert not any(k.startswith("peak_") for k in m["rank0_only_keys"])
        assert not any(k.endswith(("_min", "_max")) for k in m["rank0_only_keys"])
        assert "across_ranks" in m["refused"] and "MemoryHighWaterMark" in m["refused"]
        if run["size"] == 2:
            assert {"peak_host_rss_mib_min", "peak_host_rss_mib_max"} <= set(m["across_keys"])
            assert m["rss_max"] >= m["rss"]
    if run["size"] == 2:
        assert res[0]["rss_max"] == res[1]["rss_max"]


def test_horovod_names_and_collectives_on_values(run):
    size = run["size"]
    for r, a in zip(run["ranks"], scenario(run, "api_parity")):
        assert a["missing"] == []
        assert a["allreduce_average"] == pytest.approx((size + 1) / 2)
        assert a["allreduce_fp16"] == pytest.approx((size + 1) / 2)
        assert a["allreduce_sum"] == pytest.approx([size * (size + 1) / 2, size])
        assert a["allgather"] == [[k, k] for k in range(size) for _ in range(k + 1)]
        assert a["broadcast"] == 10.0
        full = [x * size * (size + 1) / 2 for x in range(4)]
        assert a["reducescatter"] == pytest.approx(full[r["rank"] * 4 // size:(r["rank"] + 1) * 4 // size])
        assert a["is_initialized"] is True and a["cross"] == [0, 1]
        if r["rank"] == 0:
            assert a["timeline_bytes"] > 0
        assert "BroadcastGlobalVariablesCallback" in a["bgv_error"] and "broadcast_variables" in a["bgv_error"]


# Horovod 0.28.1's positional order (horovod/tensorflow/keras/__init__.py and callbacks.py); ours may add
# keyword-only arguments after them.
HOROVOD_SIGNATURES = {
    "DistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                             "gradient_predivide_factor", "op", "backward_passes_per_step",
                             "average_aggregated_gradients", "num_groups", "groups", "process_set",
                             "scale_local_gradients"],
    "PartialDistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression",
                                    "sparse_as_dense", "gradient_predivide_factor", "op", "groups", "process_set",
                                    "local_layers", "scale_local_gradients"],
    "load_model": ["filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"],
    "allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "allgather": ["value", "name"],
    "broadcast": ["value", "root_rank", "name"],
    "reducescatter": ["value", "name", "op"],
    "BroadcastGlobalVariablesCallback": ["root_rank", "device", "local_variables"],
    "MetricAverageCallback": ["device"],
    "LearningRateScheduleCallback": ["initial_lr", "multiplier", "start_epoch", "end_epoch", "staircase",
                                     "momentum_correction", "steps_per_epoch"],
    "LearningRateWarmupCallback": ["initial_lr", "warmup_epochs", "momentum_correction", "steps_per_epoch",
                                   "verbose"],
    "BestModelCheckpoint": ["monitor", "verbose", "save_weights_only", "mode", "save_freq"],
}


def test_positional_order_and_defaults_match_horovod(run):
    a = scenario(run, "api_parity")[0]
    for name, expected in HOROVOD_SIGNATURES.items():
        assert a["signatures"][name][:len(expected)] == expected, name
    assert a["named"] == "my_gradients"
    assert a["defaults"] == [False, "per_pass", True]  # average_aggregated_gradients=False, as in Horovod
    assert "backward_passes_per_step=" in a["positional_int_error"]


def test_grouping_predivide_and_sum_match_reference(run):
    for r in scenario(run, "other_optimizers"):
        for label in ("groups_2", "num_groups_3", "predivide_2", "sum_half_lr"):
            assert maxdiff(r[label]["final"], r[label]["reference"]) < TOL, label


def test_local_variables(run):
    res = scenario(run, "local_variables")
    for r in res:
        for label in ("register", "partial", "partial_unscaled"):
            assert r[label]["local_error"] < 1e-6, label
    if run["size"] == 2:
        for label in ("register", "partial", "partial_unscaled"):
            assert res[0][label]["shared"] == res[1][label]["shared"], label
            assert res[0][label]["local"] != res[1][label]["local"], label


def test_process_set_limits_the_allreduce(run):
    need_two_ranks(run)
    res = scenario(run, "process_sets")
    for r, p in zip(run["ranks"], res):
        assert p["set_ranks"] == [r["rank"]] and p["included"]
        assert maxdiff(p["final"], p["own_reference"]) < TOL
    assert maxdiff(res[0]["final"], res[1]["final"]) > 1e-3  # not averaged with the other rank


def test_best_model_checkpoint_and_device(run):
    for r, b in zip(run["ranks"], scenario(run, "best_checkpoint_and_device")):
        assert b["written"] == (r["rank"] == 0) and b["loads"] == (r["rank"] == 0)
        assert "filepath" in b["missing_path_error"]


def test_layer_name_skew_across_ranks_does_not_hang(run):
    """Ranks that built different numbers of layers before the model still allreduce the same gradients (a hang
    here would time the whole launch out)."""
    need_two_ranks(run)
    ranks = scenario(run, "layer_name_skew")
    assert ranks[0]["layers"] != ranks[1]["layers"], "negative control: the layer names must differ"
    np.testing.assert_allclose(ranks[0]["weights"], ranks[1]["weights"], rtol=0, atol=1e-6)


def test_horovods_own_elastic_state_test_passes(run):
    """Horovod's `test_elastic_state` (its Keras suite), imports changed: plain, wrapped and mixed precision pass;
    the control (Horovod's own `horovod.tensorflow.keras.elastic.KerasState`) fails on Keras 3."""
    for results in scenario(run, "upstream_elastic_state"):
        for case in ("plain", "wrapped", "mixed_float16"):
            assert results[case]["ok"], f"{case}:\n{results[case]['error']}"
        assert results["mixed_float16"]["optimizer_variables"] > results["plain"]["optimizer_variables"]
        assert not results["control_upstream"]["ok"], "Horovod's own KerasState should fail on Keras 3"
        assert "is not callable" in results["control_upstream"]["error"]


def test_load_model_custom_optimizers(run):
    r = scenario(run, "saving")[0]
    assert r["custom_loaded"] == ["MySGD", True, True]
    assert "custom_optimizers" in r["dict_error"] and "custom_objects=" in r["dict_error"]
