"""benchmarks/gpu_step_profile.py: the kernel classes and busy-time unions it reports from a chrome trace, and its
``--smoke`` code path on the CPU (run from the repository root as documented)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch  # the benchmark profiles the torch back end

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_breakdown_classes_and_unions():
    from benchmarks.gpu_step_profile import breakdown, kernel_class

    assert kernel_class("sm90_xmma_fprop_implicit_gemm_f32f32_tf32") == "convolution"
    assert kernel_class("Memcpy DtoH (Device -> Pinned)") == "device->host copy"
    assert kernel_class("void at::native::elementwise_kernel<direct_copy_kernel_cuda>") == \
        "copies (permute/contiguous)"
    trace = {"traceEvents": [
        _kernel("implicit_gemm conv", 0, 10), _kernel("vectorized_elementwise_kernel", 5, 10),  # overlap: 15 us busy
        _kernel("Memcpy HtoD (Pinned -> Device)", 0, 4, "gpu_memcpy"),
        _kernel("Memcpy DtoH (Device -> Pinned)", 4, 4, "gpu_memcpy"),  # back to back: 8 us
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv", "ts": 0, "dur": 100},  # host side: not counted
    ]}
    got = breakdown(trace, steps=1)
    assert got["compute_busy_s"] == pytest.approx(15e-6)
    assert got["copy_busy_s"] == pytest.approx(8e-6)
    assert got["by_class_s"]["convolution"] == pytest.approx(10e-6)
    assert got["by_class_s"]["element-wise"] == pytest.approx(10e-6)
    assert "other" not in got["by_class_s"]
    assert breakdown(trace, steps=2)["compute_busy_s"] == pytest.approx(7.5e-6)  # per step


def test_gpu_step_profile_smoke(tmp_path):
    out = tmp_path / "prof"
    env = dict(os.environ, KERAS_BACKEND="torch")
    cmd = [sys.executable, "-m", "benchmarks.gpu_step_profile", "--smoke", "--profile", "h100-pcie5",
           "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "summary.json").read_text())
    assert list(data["modes"]) == ["plain", "offload-only", "time-aware"]
    assert all(m["wall_s"] > 0 for m in data["modes"].values())
    assert "| wall |" in (out / "summary.md").read_text()
