"""Runs Horovod 0.28.1's elastic Keras integration suite (the files in this folder, see README.md) under pytest here.

What the suite needs from its surroundings, given here so that the upstream files stay as a migrating user edits
them: the `horovod` mark and a skip where Horovod has no Gloo (as the rest of tests/horovod); workers that import
this checkout's keras_lms, hide the GPUs and use one thread each (the environment `horovodrun` hands them: the
suite launches in this process); `python` on PATH being this interpreter (upstream's command is
`horovodrun ... python <script>`); and no build check before every launch (horovodrun's `gloo_built` imports
TensorFlow in a child process, ~7 s a launch; asked once per session instead, see tests/horovod/_horovodrun.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.horovod.test_horovod_multirank import rank_env, skip_unless_available

HERE = Path(__file__).resolve().parent
# Upstream's modules import horovod.runner when collected: without Horovod (e.g. `make test-fast` before `make
# install` built it) they are left out of the collection instead of failing it.
collect_ignore = [] if importlib.util.find_spec("horovod") else ["test_elastic_tensorflow_keras.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.horovod)


@pytest.fixture(autouse=True)
def _upstream_suite_environment(monkeypatch):
    skip_unless_available("gloo")
    from horovod.runner import launch

    monkeypatch.setattr(launch, "gloo_built", lambda verbose=False: True)  # checked once per session (above)
    for key, value in rank_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
