"""The torch back end's tests run only under KERAS_BACKEND=torch (a separate pytest invocation).

Keras picks its back end once per process, so the TensorFlow suite and this one cannot share a process:
``make test`` runs ``pytest tests`` (TensorFlow; this directory is ignored) and then
``KERAS_BACKEND=torch pytest tests/torch``.
"""

import os

if os.environ.get("KERAS_BACKEND") != "torch":
    collect_ignore_glob = ["*.py"]
else:
    import pytest

    @pytest.fixture(autouse=True)
    def _cpu_host_copies(monkeypatch):
        """Without CUDA, make offloading really copy into pool buffers, so the tests exercise the data path."""
        from keras_lms.offload import torch as lms_torch

        monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", True)
        yield

    @pytest.fixture
    def no_host_copies(monkeypatch):
        from keras_lms.offload import torch as lms_torch

        monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", False)
        yield
