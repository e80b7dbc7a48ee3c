"""python -m benchmarks.gpu_bench --smoke: the GPU benchmark's code path on CPU (tiny sizes, simulated memory
limits), run from the repository root as documented."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch  # the benchmark measures the torch back end

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_gpu_bench_smoke(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, KERAS_BACKEND="torch")
    cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--smoke", "--out", str(out),
           "--max-edge", "32", "--simulate-oom-mvoxels", "0.003,0.02",
           # the time-aware plan made for a PCIe GPU (on the CPU's own calibrated profile copies are cheap and
           # it would recompute nothing), its bytes predicted on the calibrated profile
           "--timed-profile", "h100-pcie5"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert set(data) >= {"meta", "bandwidth", "max_edge", "timing", "errors"}
    assert data["meta"]["complete"] is True and data["meta"]["backend"] == "torch"
    assert data["errors"] == []
    assert data["bandwidth"]["skipped"] == "no CUDA device"
    edges = data["max_edge"]
    # simulated limits: plain fits 12^3 (< 3000 voxels), wrapped fits 24^3 (< 20000 voxels); edges step by 4
    assert edges["plain"]["edge"] == 12 and edges["plain"]["first_failure"] == 16
    assert edges["lms"]["edge"] == 24 and edges["lms"]["first_failure"] == 28
    assert edges["voxel_ratio"] == (24 / 12) ** 3
    assert any(not t["ok"] and t["error"] == "device OOM" for t in edges["plain"]["trials"])
    assert [t["edge"] for t in data["timing"]] == [8, 12]
    for t in data["timing"]:
        assert {"plain_ms", "lms_ms", "plain_peak_gib", "lms_peak_gib", "offloaded_gib", "d2h_gib", "h2d_gib",
                "lower_bound_ms", "ratio_to_lower_bound", "ratio_to_plain"} <= set(t)
        assert t["plain_ms"] > 0 and t["lms_ms"] > 0 and t["offloaded_gib"] > 0 and t["d2h_gib"] > 0
        # the report's prediction on the profile calibrated in the same run, beside the measurement; the
        # torch offloader's counters agree with the predicted traffic (CPU host copies: the same code path)
        assert t["predicted_lms_ms"] >= t["predicted_plain_ms"] > 0
        assert t["predicted_d2h_gib"] == pytest.approx(t["d2h_gib"], rel=0.10)
        assert t["predicted_h2d_gib"] == pytest.approx(t["h2d_gib"], rel=0.10)
        # the time-aware plan on the same profile: it recomputes what it planned to, copies less than the
        # offload-only plan, and the offloader's counters agree with its prediction
        assert t["timed_recomputed"] == t["timed_recomputed_planned"] > 0
        assert t["timed_d2h_gib"] < t["d2h_gib"] and t["timed_h2d_gib"] < t["h2d_gib"]
        assert t["predicted_timed_d2h_gib"] == pytest.approx(t["timed_d2h_gib"], rel=0.10)
        assert t["predicted_timed_h2d_gib"] == pytest.approx(t["timed_h2d_gib"], rel=0.10)
        assert t["timed_ms"] > 0 and t["predicted_timed_ms"] > 0
    assert data["profile"]["name"] == "smoke-cpu" and (out / "profile.json").is_file()
    md = (out / "results.md").read_text()
    assert "Voxel ratio wrapped / plain" in md and "| 12 |" in md and "Predicted by" in md
    assert "The time-aware plan" in md
