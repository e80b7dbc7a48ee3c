"""Device memory of a torch training step, measured on the CPU: the live bytes of the tensor storages the step
produces (benchmarks/torch_cpu_peak.py's dispatch-mode tracker), plain vs wrapped, with Python's cyclic garbage
collector on and off (issue 15: offloaded activations must die by reference counting, not at a collection)."""

import gc

import keras
import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import keras_lms
from benchmarks.models import build_unet
from benchmarks.torch_cpu_peak import LiveStorageTracker, step_peak, tracking
from keras_lms.offload import torch as lms_torch

pytestmark = pytest.mark.torch


@pytest.fixture
def collector_restored():
    was = gc.isenabled()
    yield
    if was:
        gc.enable()


def test_tracker_counts_new_storages_not_views_or_weights():
    weight = torch.rand(256, 256)
    with tracking() as t:
        view = weight.t()  # a view of a weight: not new memory
        y = torch.rand(64, 256) @ view  # 64 KiB input (alive until the next op) + 64 KiB output
        assert t.current == 2 * 64 * 256 * 4
        del y
        z = torch.relu(torch.ones(1))
        assert t.current == 2 * 4  # y and the random input died; ones(1) and its relu are alive
    assert t.peak == 2 * 64 * 256 * 4 and z.numel() == 1 and view.shape == (256, 256)
    assert isinstance(t, LiveStorageTracker)


def _unet_case():
    keras.utils.set_random_seed(0)
    model = build_unet((32, 32, 32, 1), depth=2, base_filters=8, dropout=0.1)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.random((2, 32, 32, 32, 1)).astype("float32")
    y = (rng.random((2, 32, 32, 32, 1)) > 0.5).astype("float32")
    return model, x, y


def test_wrapped_peak_without_the_collector_is_below_plain_as_the_report_predicts(collector_restored):
    """Issue 15: with ``gc.disable()`` for the whole step (what a GPU sees: a collection runs on Python's allocation
    counts, not on device memory) the wrapped step's peak is below the plain one, and the same as with the
    collector running (within one activation). How far below, against the report: test_memory_model_calibration.py
    (this small 3D case is where the report is least accurate: its wrapped/plain ratio 18% under the measured)."""
    model, x, y = _unet_case()
    plain = step_peak(model, x, y, gc_enabled=False)["peak"]
    wrapped = keras_lms.wrap(model, min_bytes="256KiB", keep_last=1)
    wrapped.compile(optimizer="adam", loss="binary_crossentropy")
    no_gc = step_peak(wrapped, x, y, gc_enabled=False)
    with_gc = step_peak(wrapped, x, y, gc_enabled=True, warmup=False)["peak"]
    assert no_gc["d2h_copies"] > 0
    assert no_gc["peak"] < 0.6 * plain, (no_gc["peak"], plain)
    activation = 2 * 32**3 * 8 * 4  # one full-resolution 8-channel activation
    assert abs(no_gc["peak"] - with_gc) <= activation, (no_gc["peak"], with_gc)


def test_forward_originals_die_without_the_collector(collector_restored):
    """The device original of an offloaded tensor dies when its last forward consumer is done, also with the
    collector off (Keras' torch tree utilities used to keep every flattened tensor in a reference cycle)."""
    model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64, activation="relu") for _ in range(4)])
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    x = torch.rand(8, 64)
    wrapped(x, training=True).sum().backward()
    refs = []
    swap_out = lms_torch.StepContext.swap_out

    def spy(self, tensor):
        if tensor is not x:
            refs.append(StorageWeakRef(tensor.untyped_storage()))
        return swap_out(self, tensor)

    gc.collect()
    gc.disable()
    lms_torch.StepContext.swap_out = spy
    try:
        out = wrapped(x, training=True)
    finally:
        lms_torch.StepContext.swap_out = swap_out
    assert len(refs) == 3 and all(ref.expired() for ref in refs)
    out.sum().backward()
