"""The API reference builds (scripts/api_docs.py, pdoc) and every docstring `Example:` runs as written."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow(
    reason="the reference documents keras_lms.horovod (TensorFlow only); the examples run in TensorFlow subprocesses")

REPO = pathlib.Path(__file__).resolve().parents[1]
API_DOCS = runpy.run_path(str(REPO / "scripts" / "api_docs.py"), run_name="api_docs")
HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None


def _env():
    return dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")


def _run(code: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.skipif(not HAVE_HOROVOD, reason="the reference documents keras_lms.horovod, which needs Horovod")
def test_api_reference_builds(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "api_docs.py"), str(tmp_path / "api")], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    index = (tmp_path / "api" / "keras_lms.html").read_text()
    for name in ("wrap", "LMSConfig", "BudgetError", "HostMemoryError", "MemoryHighWaterMark"):
        assert f'id="{name}"' in index, name
    assert "Raises" in index and "Example" in index
    assert (tmp_path / "api" / "keras_lms" / "horovod.html").exists()


def test_docstring_checker_catches_a_missing_section(monkeypatch):
    assert API_DOCS["check_docstrings"]() == []
    api = dict(API_DOCS["API"], **{"keras_lms:PlanEntry": ("Args", "Example")})
    monkeypatch.setitem(API_DOCS["check_docstrings"].__globals__, "API", api)
    problems = API_DOCS["check_docstrings"]()
    assert any(p.startswith("keras_lms:PlanEntry: no 'Example:'") for p in problems), problems


def _examples(horovod: bool) -> str:
    blocks = []
    for target in API_DOCS["API"]:
        if target.startswith("keras_lms.horovod") != horovod:
            continue
        for code in API_DOCS["examples"](target):
            blocks.append(f"print('--- example of {target}', flush=True)\nexec({code!r}, {{}})")
    assert blocks
    return "\n".join(blocks)


def test_docstring_examples_run():
    out = _run(_examples(horovod=False))
    assert out.count("--- example of") == sum(not t.startswith("keras_lms.horovod") for t in API_DOCS["API"])


@pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod is not installed")
def test_horovod_docstring_examples_run():
    out = _run(_examples(horovod=True))  # plain python: Gloo-only Horovod runs as one rank of size 1
    assert "--- example of keras_lms.horovod:DistributedOptimizer" in out
