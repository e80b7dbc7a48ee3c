"""Elastic Horovod on Keras 3 (keras_lms.horovod.elastic), each case a real `horovodrun --min-np/--max-np
--host-discovery-script` job on localhost whose discovery output the test changes during the run.

Two "hosts" on one machine: ``localhost`` and ``127.0.0.1`` are both local addresses, so Horovod starts their
workers here, and each is a host of its own to the elastic driver (which blacklists the host of a failed worker,
as it would a dead node). The worker (tests/horovod/_elastic_worker.py) logs every commit and reset; the tests
assert on those logs. Every launch has a hard timeout; its process group is killed on expiry. The "added" and
"removed" cases share one job (1 -> 2 -> 1 ranks); the no-retrace control is killed once the job has been silent
for `STALL` seconds after the join (a hang), rather than at the timeout.
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

from tests.horovod.test_horovod_multirank import HOROVODRUN, REPO, rank_env, skip_unless_available, tail

pytestmark = pytest.mark.horovod

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_elastic_worker.py"
TIMEOUT = 150  # seconds per launch; a job here takes 25-40 s on 2 cores
STALL = 15  # seconds without a commit after a join that make a hang (a working job commits every few 0.1 s)
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
        self.command = [*HOROVODRUN, "--gloo", "--network-interface", "lo", "-np", str(np_),
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

    def run(self, *steps, give_up=None, timeout: float = TIMEOUT) -> tuple[int | None, str, float]:
        """Launch, and take `steps` in order: each a pair ``(when, then)``; once ``when(events)`` holds, ``then()``
        is called (e.g. to change the hosts) and the next step waits. ``give_up(events)``: kill the job as soon
        as it holds (a hang recognised sooner than by `timeout`). Returns (rc, log, seconds); rc None: killed."""
        t0 = time.monotonic()
        proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=REPO, start_new_session=True)
        chunks = []
        reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
        reader.start()
        pending = list(steps)
        rc = None
        while rc is None and time.monotonic() - t0 < timeout:
            events = self.events() if pending or give_up else []
            if pending and pending[0][0](events):
                pending.pop(0)[1]()
            rc = proc.poll()
            if rc is None and give_up is not None and give_up(events):
                break
            time.sleep(0.2)
        if rc is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
        return rc, "".join(chunks), time.monotonic() - t0


def commits(events):
    return [e for e in events if e["event"] == "commit"]


def after_commit(epoch: int, batch: int = 1):
    return lambda events: any(e["epoch"] >= epoch and e["batch"] >= batch for e in commits(events))


def committed_by(size: int):
    """True once `size` different workers have committed in a job of `size` ranks."""
    return lambda events: len({e["pid"] for e in commits(events) if e["size"] == size}) >= size


def joined(size: int):
    """True once a rank has started, or reset, in a job of `size` ranks."""
    return lambda events: any(e["event"] in ("start", "reset") and e["size"] == size for e in events)


def stalled_after_join(size: int, seconds: float):
    """True once `size` ranks have formed and then no rank logged anything (a commit every batch) for `seconds`.

    A job that works commits every few tenths of a second, and takes a few seconds after a join (sync, retrace);
    `seconds` of silence after the join is a hang.
    """
    return lambda events: joined(size)(events) and time.time() - events[-1]["time"] > seconds


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


@pytest.fixture(scope="module")
def grown_then_shrunk(tmp_path_factory):
    """One job, 1 -> 2 -> 1 ranks (one launch for the "added" and the "removed" test): the second host is listed at
    epoch 0, batch 2, and removed again once both ranks have committed at size 2. The first rank trains on while
    the new worker starts (about 10 s); 4 epochs leave it more than an epoch to notice the removal."""
    skip_unless_available("gloo")
    job = ElasticJob(tmp_path_factory.mktemp("grow_shrink"), [f"{HOSTS[0]}:1"], 1, 1, 2,
                     env={"ELASTIC_EPOCHS": "4", "ELASTIC_STEPS": "8"})
    both = [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"]
    rc, log, _ = job.run((after_commit(0, 2), lambda: job.set_hosts(both)),
                         (committed_by(2), lambda: job.set_hosts([f"{HOSTS[0]}:1"])))
    finals = assert_one_job(job, rc, log, size_after=1, epochs=4)
    return job, finals


def test_rank_added_mid_run_joins_with_the_committed_state(grown_then_shrunk):
    """1 -> 2 ranks mid-run: the new worker gets rank 0's state, and both commit the same weights."""
    job, _ = grown_then_shrunk
    events = job.events()
    assert any(e["event"] == "reset" and e["size"] == 2 for e in events), "no reset to 2 ranks"
    two = [e for e in commits(events) if e["size"] == 2]
    assert len({e["pid"] for e in two}) == 2, "the new rank did not train"
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
    rc, log, _ = job.run((after_commit(1, 1), lambda: job.set_hosts([f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"])),
                         give_up=stalled_after_join(2, STALL), timeout=60)
    assert joined(2)(job.events()), f"the second rank never joined, so the control shows nothing:\n{tail(log)}"
    finals = job.finals()
    assert rc is None or rc != 0 or len({f["weights"] for f in finals}) > 1, finals


def test_rank_removed_mid_run_by_discovery(grown_then_shrunk):
    """2 -> 1 rank (the host leaves the discovery output): the remaining rank resets to 1 and finishes."""
    job, finals = grown_then_shrunk
    assert any(e["event"] == "reset" and e["size"] == 1 for e in job.events())
    assert [f["size"] for f in finals] == [1]


def test_fewer_than_min_np_every_rank_exits_nonzero_within_60s(tmp_path):
    """--min-np 2 and a rank killed: after the elastic timeout the job and every rank end with an error."""
    job = ElasticJob(tmp_path, [f"{HOSTS[0]}:1", f"{HOSTS[1]}:1"], 2, 2, 2, elastic_timeout=10,
                     env={"ELASTIC_KILL": "1:3:1", "ELASTIC_EPOCHS": "3"})
    t_kill = []
    rc, log, secs = job.run((lambda ev: (job.out / "killed").exists(), lambda: t_kill.append(time.time())))
    assert rc is not None, f"hung:\n{tail(log)}"
    assert rc != 0 and not job.finals(), tail(log)
    assert t_kill and time.time() - t_kill[0] <= 60 + 10, "the job took longer than 60 s past the elastic timeout"
    import re

    codes = [int(c) for c in re.findall(r"Process \d+ exit with status code (-?\d+)", log)]
    assert codes and all(c != 0 for c in codes), tail(log)  # every rank ended with an error


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
