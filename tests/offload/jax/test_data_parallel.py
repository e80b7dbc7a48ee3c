"""Data parallelism on JAX is Keras' own (``keras.distribution.DataParallel``, docs/horovod.md): a wrapped model
trains under it on two CPU devices exactly as the plain model trains on one device at the doubled batch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")

pytestmark = [pytest.mark.jax, pytest.mark.slow]

WORKER = pathlib.Path(__file__).with_name("data_parallel_worker.py")


def _max_relative(a, b) -> float:
    """Largest relative difference of two models' variables; a variable whose norm is under 1e-2 is compared to
    1e-2 (the bias of a convolution before BatchNorm has a zero gradient: its value is rounding noise ~1e-9)."""
    return max(float(np.linalg.norm(np.subtract(x, y)) / max(np.linalg.norm(x), 1e-2)) for x, y in zip(a, b))


def test_wrapped_model_under_data_parallel_matches_one_device_at_the_doubled_batch():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip(),
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[3]), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert len(result["devices"]) == 2
    reference, parallel, control = result["reference"], result["data_parallel"], result["half_batch"]
    assert result["offloaded"] > 0
    assert len(parallel["devices"]) == 2, "the weights are not replicated on both devices: DataParallel did not run"
    assert abs(parallel["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"])
    assert _max_relative(reference["variables"], parallel["variables"]) < 1e-5
    # the control: one device at the per-device batch trains to other weights, so the comparison can fail
    assert _max_relative(reference["variables"], control["variables"]) > 1e-3
