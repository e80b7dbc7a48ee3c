"""The step-time model against the GPU run recorded in docs/gpu_runs/2026-12-04-h200 (benchmarks/gpu_replay.py).

A GPU is lent to few sessions; this keeps the model honest between them. The replay plans the recorded U-Nets
again and predicts them on the run's calibrated profile (with its per-channel convolution rates): the replayed
plans must be the ones that ran (their bytes equal the offloader's counts on the GPU), and the plain steps, where
nothing but the compute model is involved, must be predicted within 15% of what the H200 measured (they were
2.2x low before the model counted torch's eager element-wise passes, its layout copies and the convolution rate
per channel count). The control: the same replay on the run's flat profile (one median convolution rate, no
layout-copy rate) misses the plain steps by more than that.
"""

import pathlib

import pytest

from benchmarks import gpu_replay
from keras_lms.planning.device_profile import load_profile

pytestmark = pytest.mark.torch

RUN = pathlib.Path(__file__).parents[3] / "docs" / "gpu_runs" / "2026-12-04-h200"


def _plain_ratios(rows):
    return [r["measured_over_predicted"] for r in rows if r["plan"] == "plain"]


def test_the_model_predicts_the_recorded_h200_steps(tmp_path):
    assert gpu_replay.main([str(RUN), "--out", str(tmp_path)]) == 0  # every replayed plan is the plan that ran
    import json

    replay = json.loads((tmp_path / "replay.json").read_text())
    assert replay["profile"] == "nvidia-h200-by-channels"
    assert all(0.85 <= r <= 1.15 for r in _plain_ratios(replay["timing"])), replay["timing"]
    # the wrapped steps: their copies wait for the compute and each other as they ran, not ~2x faster
    assert all(0.8 <= r["measured_over_predicted"] <= 1.7 for r in replay["timing"]), replay["timing"]


def test_control_the_flat_profile_misses_the_plain_steps():
    import json

    run = json.loads((RUN / "results.json").read_text())
    flat = load_profile(str(RUN / "profile.json"))
    rows = gpu_replay.replay_timing(run, flat, flat)
    assert not all(0.85 <= r <= 1.15 for r in _plain_ratios(rows))
