"""examples/quickstart.py and its Horovod twin run as documented and print the plan and the report."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow(reason="the quickstarts run in TensorFlow subprocesses")

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
TIMEOUT = 240  # seconds; each run trains for a few seconds, start-up dominates


def _env():
    return dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", PYTHONUNBUFFERED="1",
                PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # horovodrun starts `python` by PATH


def _run(cmd) -> str:
    """Run in its own process group (horovodrun starts children); on timeout kill the group and fail."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} timed out after {TIMEOUT} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-5000:]
    return out


def _check(out: str):
    assert "Epoch 2/2" in out and "peak_host_rss_mib" in out and "offloaded_mib: 13.75" in out
    assert out.count("PlanEntry(") == 8 and "offloaded: 1 input tensor(s)" in out
    assert "keras-lms activation report: quickstart_cnn, batch size 16" in out
    assert "predicted device peak, with LMS" in out


def test_quickstart():
    _check(_run([sys.executable, "examples/quickstart.py"]))


def test_quickstart_as_module():
    out = _run([sys.executable, "-m", "examples.quickstart", "--epochs", "1", "--min-bytes", "0"])
    assert "loss:" in out and out.count("PlanEntry(") == 8


@pytest.mark.horovod
def test_quickstart_horovod_two_ranks():
    if not (BIN / "horovodrun").exists():
        pytest.skip(f"Horovod is not installed in {BIN} (make install)")
    out = _run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                "examples/quickstart_horovod.py"])
    _check(out)
    assert "2 rank(s). Offload plan" in out
    assert out.count("keras-lms activation report") == 1  # rank 0 only
