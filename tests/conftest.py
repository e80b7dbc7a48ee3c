"""One suite for both Keras backends: ``KERAS_BACKEND=tensorflow pytest tests`` and ``KERAS_BACKEND=torch pytest
tests`` (Keras picks its backend once per process, so each backend is its own pytest run).

A test is backend-neutral unless marked: ``@pytest.mark.tensorflow`` / ``@pytest.mark.torch`` (a module says it
with ``pytestmark``) make it run only under that backend; under the other one it is skipped, with the marker's
``reason=`` where it has one.
Everything under tests/offload/torch/ is torch-only, everything under tests/offload/jax/ JAX-only (``make
test-jax-compile``: its own environment with the jax CUDA plugin) and everything under tests/horovod/ TensorFlow-only,
whether or not the module repeats the marker (``_PATH_BACKEND``).
"""

import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's default CPU allocator keeps statistics only on NUMA machines; the BFC one always does, and the
# callback and memory tests read them (keras_lms.memory warns and logs NaN without them).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras
import pytest

BACKEND = keras.backend.backend()
if BACKEND == "jax" and not os.environ.get("KERAS_LMS_REQUIRE_GPU_COMPILE"):
    # XLA compiles a program again whenever a test rebuilds a model an earlier test compiled (same architecture,
    # seed and shapes: the plain model of each parametrization of an oracle test, the zoo models many modules
    # share). JAX's compilation cache hands the compiled program back (the 2D U-Net's train step: 5.7 s -> 0.3 s
    # on the 2-core machine); its directory belongs to this run alone, so a run never reuses another's programs.
    # Not in `make test-jax-compile`, whose tests read the memory analysis of the programs they compile.
    import atexit
    import shutil
    import tempfile

    import jax

    _JAX_CACHE = tempfile.mkdtemp(prefix="keras-lms-jax-cache-")
    atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
BACKEND_MARKERS = ("tensorflow", "torch", "jax")
_HERE = pathlib.Path(__file__).resolve().parent
# Paths under tests/ that belong to one backend as a whole: the directory (or module) -> (backend, reason).
_PATH_BACKEND = {
    "offload/torch": ("torch", None),
    "offload/jax": ("jax", None),
    "horovod": ("tensorflow", "keras_lms.horovod runs on TensorFlow"),
}


@pytest.hookimpl(tryfirst=True)  # before -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            relative = item.path.resolve().relative_to(_HERE).as_posix()
        except ValueError:
            continue
        prefix = next((p for p in _PATH_BACKEND if relative.startswith(p + "/")), None)
        backend, reason = _PATH_BACKEND.get(prefix, (None, None))
        if backend is not None and item.get_closest_marker(backend) is None:
            item.add_marker(getattr(pytest.mark, backend)(**({"reason": reason} if reason else {})))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Skip a backend-marked test under another backend, before its fixtures run."""
    wanted = [name for name in BACKEND_MARKERS if item.get_closest_marker(name) is not None]
    if wanted and BACKEND not in wanted:
        reasons = [m.kwargs["reason"] for name in wanted for m in item.iter_markers(name) if "reason" in m.kwargs]
        pytest.skip(f"{' / '.join(wanted)}-only test (KERAS_BACKEND={BACKEND})" + "".join(f": {r}" for r in reasons))


@pytest.fixture(autouse=True)
def _torch_host_copies(monkeypatch):
    """On torch without CUDA, make offloading really copy into pool buffers, so every test exercises the data
    path (the CPU default hands the tensor itself back; see ``no_host_copies``)."""
    if BACKEND == "torch":
        from keras_lms.offload import torch as lms_torch

        monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", True)
    yield


@pytest.fixture
def no_host_copies(monkeypatch):
    """torch only: the CPU default, where the 'host copy' of a tensor is the tensor itself."""
    from keras_lms.offload import torch as lms_torch

    monkeypatch.setattr(lms_torch, "CPU_HOST_COPIES", False)
    yield


def _edit_every_plan(monkeypatch, edit) -> None:
    """Every plan made afterwards (``planning.step.build_plan``) passes through ``edit(entries)``."""
    from keras_lms.planning import step as planning_step

    build = planning_step.build_plan

    def build_plan(*args, **kwargs):
        entries = build(*args, **kwargs)
        edit(entries)
        return entries

    monkeypatch.setattr(planning_step, "build_plan", build_plan)


@pytest.fixture
def planned_prefetch(monkeypatch):
    """``planned_prefetch(depth)``: every plan made afterwards says copies back start ``depth`` calls ahead
    (``PlanEntry.prefetch``), as the time-aware planner (``planning.prefetch_plan.plan_prefetch``) may choose: for the
    back ends' tests that the step runs the plan's depth, not ``LMSConfig.prefetch``."""

    def plan_with(depth: int) -> None:
        def edit(entries):
            for entry in entries:
                entry.prefetch = depth

        _edit_every_plan(monkeypatch, edit)

    return plan_with


@pytest.fixture
def planned_leads(monkeypatch):
    """``planned_leads({index: lead})``: every plan made afterwards starts those calls' copies back ``lead`` calls
    ahead (``PlanEntry.copy_back_lead``), as ``planning.copy_back_leads`` may choose: for the back ends' tests
    that the step runs each call's own lead, not one depth for all."""

    def plan_with(leads: dict) -> None:
        def edit(entries):
            for index, lead in leads.items():
                entries[index].copy_back_lead = lead

        _edit_every_plan(monkeypatch, edit)

    return plan_with


@pytest.fixture
def mixed_precision():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture
def dtype_policy(request):
    """Float type and dtype policy for one test (indirect parametrisation), restored to float32 afterwards."""
    dtype = request.param
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield dtype
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
