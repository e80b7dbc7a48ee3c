"""Elastic Horovod on Keras 3 (keras_lms.horovod.elastic), each case a real `horovodrun --min-np/--max-np
--host-discovery-script` job on localhost whose discovery output the test changes during the run.

Two "hosts" on one machine: ``localhost`` and ``127.0.0.1`` are both local addresses, so Horovod starts their
workers here, and each is a host of its own to the elastic driver (which blacklists the host of a failed worker,
as it would a dead node). The worker (tests/horovod/_elastic_worker.py) logs every commit and reset; the tests
assert on those logs. Every launch has a hard timeout; its process group is killed on expiry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.horovod.test_horovod_multirank import BIN, REPO, rank_env, skip_unless_available, tail

pytestmark = pytest.mark.horovod

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_elastic_worker.py"
TIMEOUT = 150  # seconds per launch; a job here takes 25-40 s on 2 cores
HOSTS = ("localhost", "127.0.0.1")


class ElasticJob:
    """A horovodrun elastic launch whose discovery script prints the file ``hosts`` (changed with `set_hosts`)."""

    def __init__(self, tmp: Path, hosts: list[str], np_: int, min_np: int, max_np: int, env: dict | None = None,
                 elastic_timeout: int = 600):
        self.dir, self.out = tmp, tmp / "out"
        self.out.mkdir(parents=True)
        self.hosts_file = tmp / "hosts"
        self.set_hosts(hosts)
        script = tmp / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        script.chmod(0o755)
        # --network-interface: without it the elastic driver waits for a second *machine* to probe interfaces.
        self.command = [str(BIN / "horovodrun"), "--gloo", "--network-interface", "lo", "-np", str(np_),
                        "--min-np", str(min_np), "--max-np", str(max_np), "--host-discovery-script", str(script),
                        "--elastic-timeout", str(elastic_timeout), sys.executable, str(WORKER), str(self.out)]
        self.env = {**rank_env(), "ELASTIC_PACE": "0.15", **(env or {})}

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def events(self) -> list[dict]:
        out = []
        for path in sorted(self.out.glob("events-*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return sorted(out, key=lambda e: e["time"])

    def finals(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("final-*.json"))]

    def run(self, when=None, then=None, timeout: float = TIMEOUT) -> tuple[int | None, str, float]:
        """Launch; when ``when(events)`` first holds, call ``then()`` (e.g. change the hosts). Returns (rc, log, s)."""
        t0 = time.monotonic()
        proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=REPO, start_new_session=True)
        chunks = []
        reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
        reader.start()
        fired = when is None
        rc = None
        while time.monotonic() - t0 < timeout:
            if not fired and when(self.events()):
                then()
                fired = True
            rc = proc.poll()
            if rc is not None:
                break
            time.sleep(0.2)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
        return rc, "".join(chunks), time.monotonic() - t0


def commits(events):
    return [e for e in events if e["event"] == "commit"]


def after_commit(epoch: int, batch: int = 1):
    return lambda events: any(e["epoch"] >= epoch and e["batch"] >= batch for e in commits(events))


@pytest.fixture(autouse=True)
def _gloo():
    skip_unless_available("gloo")


def assert_one_job(job, rc, log, size_after, epochs=3, steps=8):
    assert rc is not None, f"the elastic job did not finish in {TIMEOUT} s:\n{tail(log)}"
    assert rc == 0, f"the elastic job failed ({rc}):\n{tail(log)}"
    finals = job.finals()
    assert len(finals) == size_after, finals
    # Every rank finished with the same weights, all epochs done, each batch applied exactly once.
    assert len({f["weights"] for f in finals}) == 1, finals
    assert all(f["epoch"] == epochs and f["batch"] == 0 and f["size"] == size_after for f in finals), finals
    assert all(f["iterations"] == epochs * steps for f in finals), finals
    assert all(f["memory_logs"]["offloaded_mib"] > 0 for f in finals)  # MemoryHighWaterMark kept logging
    return finals


def test_rank_killed_mid_epoch_survivor_resumes_from_the_last_commit(tmp_path):
    """SIGKILL of rank 1 at epoch 1, batch 3: rank 0 restores that commit, re-forms alone and finishes."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"], 2, 1, 2,
                     env={"ELASTIC_KILL": "1:3:1", "ELASTIC_EPOCHS": "3", "ELASTIC_STEPS": "8"})
    rc, log, secs = job.run()
    assert_one_job(job, rc, log, size_after=1)
    events = job.events()
    killed_pid = int((job.out / "killed").read_text())
    survivor = [e for e in events if e["pid"] != killed_pid]
    resets = [e for e in survivor if e["event"] == "reset"]
    assert len(resets) == 1 and resets[0]["size"] == 1, resets
    last_before = [e for e in commits(survivor) if e["time"] < resets[0]["time"]][-1]
    first_after = [e for e in commits(survivor) if e["time"] > resets[0]["time"]][0]
    # The counters continue from the last commit: no batch repeated, none skipped.
    assert (last_before["epoch"], last_before["batch"]) == (1, 3), last_before
    assert (first_after["epoch"], first_after["batch"]) == (1, 4), first_after
    assert first_after["iterations"] == last_before["iterations"] + 1
    # Before the kill both ranks held the same weights at every commit.
    dead = {(e["epoch"], e["batch"]): e["weights"] for e in commits(events) if e["pid"] == killed_pid}
    alive = {(e["epoch"], e["batch"]): e["weights"] for e in commits(survivor) if e["time"] < resets[0]["time"]}
    assert dead and all(alive[k] == w for k, w in dead.items()), (dead, alive)


def test_control_upstream_run_does_not_recover_from_a_killed_rank(tmp_path):
    """Negative control: upstream's `run` does not recognise our collectives' failure (it swallows an
    `UnknownError` it does not match, or lets another error crash the rank): the survivor does not finish."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"], 2, 1, 2,
                     env={"ELASTIC_KILL": "1:3:1", "ELASTIC_CONTROL": "upstream_run", "ELASTIC_EPOCHS": "3"})
    rc, log, _ = job.run()
    finals = job.finals()
    assert rc != 0 or all(f["epoch"] < 3 and f["memory_logs"] is None for f in finals), (rc, finals)


def test_rank_added_mid_run_joins_with_the_committed_state(tmp_path):
    """1 -> 2 ranks at epoch 1: the new worker gets rank 0's state and both finish with the same weights."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1"], 1, 1, 2, env={"ELASTIC_EPOCHS": "3", "ELASTIC_STEPS": "8"})
    rc, log, _ = job.run(when=after_commit(1, 1), then=lambda: job.set_hosts([f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"]))
    assert_one_job(job, rc, log, size_after=2)
    events = job.events()
    assert any(e["event"] == "reset" and e["size"] == 2 for e in events), "no reset to 2 ranks"
    two = [e for e in commits(events) if e["size"] == 2]
    by_batch = {}
    for e in two:
        by_batch.setdefault((e["epoch"], e["batch"]), set()).add(e["weights"])
    assert by_batch and all(len(w) == 1 for w in by_batch.values()), by_batch  # averaged: identical per commit


def test_control_without_retrace_the_added_rank_trains_apart(tmp_path):
    """Negative control: the old rank keeps its step traced for one rank (no allreduce), the new one traced for
    two waits in its allreduce: once the new rank has joined, the job hangs (killed at the timeout) or, if it
    ends, the weights differ."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1"], 1, 1, 2, env={"ELASTIC_CONTROL": "no_retrace",
                                                                 "ELASTIC_EPOCHS": "3", "ELASTIC_STEPS": "8"})
    rc, log, _ = job.run(when=after_commit(1, 1), then=lambda: job.set_hosts([f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"]),
                         timeout=60)
    joined = [e for e in job.events() if e["event"] in ("start", "reset") and e["size"] == 2]
    assert joined, f"the second rank never joined, so the control shows nothing:\n{tail(log)}"
    finals = job.finals()
    assert rc is None or rc != 0 or len({f["weights"] for f in finals}) > 1, finals


def test_rank_removed_mid_run_by_discovery(tmp_path):
    """2 -> 1 rank at epoch 1 (the host leaves the discovery output): the remaining rank finishes."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"], 2, 1, 2,
                     env={"ELASTIC_EPOCHS": "3", "ELASTIC_STEPS": "8"})
    rc, log, _ = job.run(when=after_commit(1, 1), then=lambda: job.set_hosts([f"{HOSTS[0]}:1"]))
    assert_one_job(job, rc, log, size_after=1)
    assert any(e["event"] == "reset" and e["size"] == 1 for e in job.events())


def test_fewer_than_min_np_every_rank_exits_nonzero_within_60s(tmp_path):
    """--min-np 2 and a rank killed: after the elastic timeout the job and every rank end with an error."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"], 2, 2, 2, elastic_timeout=10,
                     env={"ELASTIC_KILL": "1:3:1", "ELASTIC_EPOCHS": "3"})
    t_kill = []
    rc, log, secs = job.run(when=lambda ev: (job.out / "killed").exists(), then=lambda: t_kill.append(time.time()))
    assert rc is not None, f"hung:\n{tail(log)}"
    assert rc != 0 and not job.finals(), tail(log)
    assert t_kill and time.time() - t_kill[0] <= 60 + 10, "the job took longer than 60 s past the elastic timeout"
    import re

    codes = [int(c) for c in re.findall(r"Process \d+ exit with status code (-?\d+)", log)]
    assert codes and all(c != 0 for c in codes), tail(log)  # every rank ended with an error


def test_horovods_own_elastic_state_test_passes(tmp_path):
    """Horovod's `test_elastic_state` (its Keras suite), imports changed, on 2 ranks: plain, wrapped and mixed
    precision pass; the control (Horovod's own `horovod.tensorflow.keras.elastic.KerasState`) fails on Keras 3."""
    from tests.horovod.test_horovod_multirank import launch

    rc, log, _ = launch("gloo", HERE / "_elastic_state_worker.py", tmp_path, TIMEOUT)
    assert rc == 0, tail(log)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"state-{rank}.json").read_text())
        for case in ("plain", "wrapped", "mixed_float16"):
            assert results[case]["ok"], f"rank {rank}, {case}:\n{results[case]['error']}"
        assert results["mixed_float16"]["optimizer_variables"] > results["plain"]["optimizer_variables"]
        assert not results["control_upstream"]["ok"], "Horovod's own KerasState should fail on Keras 3"
        assert "is not callable" in results["control_upstream"]["error"]


def test_reset_retraces_and_rechecks_host_memory_for_the_ranks_now_on_the_node(monkeypatch):
    """In-process (one rank): after `KerasState.reset` the step is retraced and the wrapped model re-plans, so the
    host-RAM guard counts the ranks now on this node. Control: before the reset the cached plan is used."""
    import keras
    import numpy as np

    import keras_lms
    import keras_lms.horovod as hvd
    from keras_lms import memory

    # init() sets the per-rank host-memory limit in os.environ when it is unset; jobs launched by later tests
    # inherit the environment, so keep it out of this process's environment after the test.
    monkeypatch.setenv("TF_GPU_HOST_MEM_LIMIT_IN_MB", os.environ.get("TF_GPU_HOST_MEM_LIMIT_IN_MB", "1024"))
    hvd.init()
    inp = keras.Input((16, 16, 1))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    model = keras_lms.wrap(keras.Model(inp, keras.layers.Conv2D(1, 1)(x)), min_bytes=0, keep_last=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
    data = np.zeros((4, 16, 16, 1), "float32")
    model.train_on_batch(data, data)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    host = model.offloaded_bytes_per_step
    assert host > 0
    # Room for this rank's host copies, not for four ranks' (what a reset to 4 ranks on this node would mean).
    monkeypatch.setattr(memory, "host_available_bytes", lambda: int(2 * host / 0.9))
    monkeypatch.setattr(memory, "ranks_on_this_node", lambda: 4)
    model.train_on_batch(data, data)  # control: the traced step and its plan are kept, no new check
    state.reset()
    assert model.train_function is None
    with pytest.raises(memory.HostMemoryError, match="host memory"):
        model.train_on_batch(data, data)
