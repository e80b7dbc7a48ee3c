"""torch back end machinery that runs without CUDA: host buffer pool, swap-in scheduling (prefetch), one host
copy per tensor, release of forward activations, activation layers' output-based gradients, planning on "meta"
tensors, host_device validation, and no TensorFlow import."""

import gc
import os
import pathlib
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import keras_lms
from benchmarks.models import build_unet
from keras_lms.offload import torch as lms_torch
from tests import models
from tests.oracle import assert_matches

pytestmark = pytest.mark.torch

ROOT = str(pathlib.Path(__file__).resolve().parents[3])


# ------------------------------------------------------------------------------------------- the pool
def test_pool_reuses_buffers_by_shape_and_dtype():
    pool = lms_torch.HostBufferPool(pin=False)
    a = pool.acquire((2, 3), torch.float32)
    b = pool.acquire((2, 3), torch.float16)
    assert a.shape == (2, 3) and a.dtype == torch.float32 and b.dtype == torch.float16
    assert not a.is_pinned() and pool.allocations == 2 and pool.lent == 2
    pool.release(a)
    pool.release(b)
    assert pool.idle_bytes() == 2 * 3 * 4 + 2 * 3 * 2
    assert pool.acquire((2, 3), torch.float32) is a  # same key: reused
    assert pool.acquire((3, 2), torch.float32) is not a  # other shape: new buffer
    assert pool.reuses == 1 and pool.allocations == 3


def test_pool_drops_buffers_of_sizes_no_longer_used():
    pool = lms_torch.HostBufferPool(pin=False)
    pool.new_step()
    pool.release(pool.acquire((4,), torch.float32))
    pool.new_step()  # the previous step's keys survive one step
    pool.release(pool.acquire((8,), torch.float32))
    assert pool.idle_bytes() == 16 + 32
    pool.new_step()  # (4,) was not used during the last step
    assert pool.idle_bytes() == 32
    pool.clear()
    assert pool.idle_bytes() == 0


def test_pool_is_reused_across_training_steps():
    model = models.unet2d()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    pool = lms_torch.offloader_of(wrapped).pool  # the model's own (tests/offload/torch/test_offloader_state.py)
    x = torch.rand(2, 32, 32, 1)

    def step():
        wrapped(x, training=True).sum().backward()

    step()
    before = pool.allocations
    gc.collect()
    assert pool.lent == 0  # every buffer came back after the backward pass
    step()
    step()
    assert pool.allocations == before  # steady state: no new host buffers
    assert pool.lent == 0
    idle = [b for buffers in pool._idle.values() for b in buffers]
    assert idle and not any(b.requires_grad or b.grad_fn is not None for b in idle)  # copies are not in the graph


# ----------------------------------------------------------------------------------------- schedule
def test_swap_in_order():
    order = lms_torch.swap_in_order
    assert order(5, {5, 4, 3}, 0) == [5]
    assert order(5, {5, 4, 3}, 1) == [5, 4]
    assert order(5, {5, 4, 3, 2}, 2) == [5, 4, 3]
    assert order(5, {3, 2}, 2) == [3]  # 5 was prefetched already, 4 is not offloaded
    assert order(1, {1, 0}, 4) == [1, 0]
    assert order(5, set(), 3) == []


def _swap_in_starts(wrapped, monkeypatch, n: int) -> tuple:
    """One backward of ``wrapped`` (a chain of ``n`` Dense calls on 16 features): the order its calls' backwards
    begin in, and which call's backward started each call's swap-in."""
    started_by, current = {}, []
    begin, start = lms_torch.StepContext.begin_backward, lms_torch._CallRecord.start_swap_in

    def spy_begin(self, record):
        current.append(record.index)
        return begin(self, record)

    def spy_start(self):
        if not self.started:
            started_by[self.index] = current[-1]
        return start(self)

    monkeypatch.setattr(lms_torch.StepContext, "begin_backward", spy_begin)
    monkeypatch.setattr(lms_torch._CallRecord, "start_swap_in", spy_start)
    x = torch.rand(4, 16, requires_grad=True)
    wrapped(x, training=True).sum().backward()
    return current, started_by


def _dense_chain(n: int):
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(n)])


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_backward_of_call_k_starts_the_swap_in_of_call_k_minus_prefetch(prefetch, monkeypatch):
    n = 8
    wrapped = keras_lms.wrap(_dense_chain(n), min_bytes=0, keep_last=0, prefetch=prefetch)
    current, started_by = _swap_in_starts(wrapped, monkeypatch, n)
    assert current == list(range(n - 1, -1, -1))  # backward runs in reverse forward order
    assert started_by == {i: min(i + prefetch, n - 1) for i in range(n)}


def test_the_planned_prefetch_is_what_the_step_runs(planned_prefetch, monkeypatch):
    # With device_profile and device_budget the planner may start copies back deeper than LMSConfig.prefetch
    # (planning.prefetch_plan.plan_prefetch, tested on its own in tests/planning/test_budget.py); the step must run
    # the plan's depth, not the config's. The plan is made to say 3 here; the config says 1.
    planned_prefetch(3)
    n = 8
    wrapped = keras_lms.wrap(_dense_chain(n), min_bytes=0, keep_last=0, prefetch=1)
    _, started_by = _swap_in_starts(wrapped, monkeypatch, n)
    assert wrapped.lms_config.prefetch == 1 and {e.prefetch for e in wrapped.lms_plan} == {3}
    assert started_by == {i: min(i + 3, n - 1) for i in range(n)}


def test_a_call_with_its_own_lead_is_started_by_that_calls_backward(planned_leads, monkeypatch):
    # planning.copy_back_leads may start one call's copies back earlier than the plan's depth
    # (PlanEntry.copy_back_lead): the backward of call i + lead starts it; the other calls keep the depth.
    planned_leads({1: 4, 2: 3})
    n = 8
    wrapped = keras_lms.wrap(_dense_chain(n), min_bytes=0, keep_last=0, prefetch=1)
    _, started_by = _swap_in_starts(wrapped, monkeypatch, n)
    assert [e.copy_back_lead for e in wrapped.lms_plan][:3] == [None, 4, 3]
    assert started_by == {i: min(i + {1: 4, 2: 3}.get(i, 1), n - 1) for i in range(n)}


def test_swap_in_order_with_one_lead_per_call():
    from keras_lms.offload.torch.step import swap_in_order

    leads = (1, 4, 3, 1, 1, 1, 1, 1)
    assert swap_in_order(5, {5, 4, 3, 2, 1}, leads) == [5, 4, 2, 1]  # call 3's lead (1) does not reach call 5
    assert swap_in_order(5, {5, 4, 3, 2, 1}, 1) == [5, 4]  # one depth for every call: as before


# --------------------------------------------------------------------------------- host copies
def test_one_host_copy_per_tensor_shared_by_consumers(monkeypatch):
    """A tensor consumed by two offloaded calls (a skip connection) is copied to host once per step."""
    inp = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(4, 3, padding="same", name="producer")(inp)
    a = keras.layers.Conv2D(4, 3, padding="same", name="consumer_a")(x)
    b = keras.layers.Conv2D(4, 1, name="consumer_b")(x)
    model = keras.Model(inp, keras.layers.Multiply()([a, b]))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    copies = []
    original = lms_torch.Transfer.to_host

    def spy(self, tensor):
        copies.append(tuple(tensor.shape))
        return original(self, tensor)

    monkeypatch.setattr(lms_torch.Transfer, "to_host", spy)
    assert_matches(model, wrapped, np.random.default_rng(0).random((2, 8, 8, 4)).astype("float32"))
    # input of producer; producer's output (read by a and b); a and b (read by Multiply): 4 distinct tensors
    assert len(copies) == 4
    entries = {e.layer: e for e in wrapped.lms_plan}
    assert entries["consumer_a"].new_host_bytes > 0 and entries["consumer_b"].new_host_bytes == 0


def test_transfer_without_cuda_copies_into_pool_buffers():
    pool = lms_torch.HostBufferPool(pin=False)
    transfer = lms_torch.Transfer(torch.device("cpu"), pool, copies=True)
    x = torch.rand(3, 5)
    host = transfer.to_host(x)
    assert host.buffer is not x and torch.equal(host.buffer, x) and pool.lent == 1
    host.pending = 1
    back = transfer.to_device(host).get()
    assert back is not host.buffer and torch.equal(back, x)
    host.done(output_reader=False)
    assert host.buffer is None and pool.lent == 0 and pool.idle_bytes() == 60
    with pytest.raises(RuntimeError, match="already released"):
        transfer.to_device(host)
    identity = lms_torch.Transfer(torch.device("cpu"), pool, copies=False)
    assert identity.to_host(x).buffer is x


def _alive_activation_bytes(model, wrapped, x, at_layer=None):
    """Bytes of layer outputs whose storage is alive after the forward pass (or when ``at_layer`` is called)."""
    refs, seen_at = [], []

    def hook(module, inputs, output):
        if output.device.type != "meta":
            refs.append((StorageWeakRef(output.untyped_storage()), output.numel() * output.element_size()))

    def alive():
        gc.collect()
        return sum(size for ref, size in refs if not ref.expired())

    hooks = [layer.register_forward_hook(hook) for layer in model.layers
             if not isinstance(layer, keras.layers.InputLayer)]
    if at_layer is not None:
        call = lms_torch.StepContext.call

        def spy(self, index, unit, original, args, kwargs):
            if unit.name == at_layer:
                seen_at.append(alive())
            return call(self, index, unit, original, args, kwargs)

        lms_torch.StepContext.call = spy
    try:
        out = wrapped(x, training=True)
    finally:
        lms_torch.StepContext.call = call if at_layer is not None else lms_torch.StepContext.call
        for h in hooks:
            h.remove()
    total = sum(size for _, size in refs)
    result = (seen_at[0] if seen_at else alive()), total
    out.sum().backward()
    return result


def test_forward_pass_releases_offloaded_activations():
    """After the forward pass only the model output is alive on the 'device'; the plain model keeps most."""
    model = build_unet((16, 16, 16, 1), depth=2, base_filters=4)
    x = torch.rand(2, 16, 16, 16, 1)
    plain_alive, total = _alive_activation_bytes(model, model, x)
    assert plain_alive > total / 2
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=1)
    wrapped_alive, total = _alive_activation_bytes(model, wrapped, x)
    output_bytes = 2 * 16**3 * 4
    assert wrapped_alive == output_bytes


def test_functional_graph_releases_intermediates_during_the_forward_pass():
    """Keras keeps a functional graph's intermediates until the forward pass returns; the wrapped step must not
    (at the last layer call, only the tensors still needed are alive)."""
    model = build_unet((16, 16, 16, 1), depth=2, base_filters=4)
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=1)
    alive, total = _alive_activation_bytes(model, wrapped, torch.rand(2, 16, 16, 16, 1), at_layer="mask")
    last_input = 2 * 16**3 * 4 * 4  # up0_conv2's output (4 channels) is the only tensor the last call needs
    assert alive == last_input < total / 10


# ----------------------------------------------------------------------------- activation layers
def test_activation_layers_take_their_gradient_from_their_output(monkeypatch):
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same")(inp)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(6, 3, padding="same")(x)
    x = keras.layers.Activation("sigmoid")(x)
    x = keras.layers.Dense(6)(x)
    x = keras.layers.Activation("tanh")(x)
    x = keras.layers.Dense(6)(x)
    x = keras.layers.Activation("elu")(x)  # recomputed: torch differentiates elu from its input
    x = keras.layers.Dense(6)(x)
    x = keras.layers.ReLU(max_value=6.0)(x)  # relu6: recomputed
    model = keras.Model(inp, keras.layers.Dense(2)(x))
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    lms_torch.reset_transfer_stats()
    recomputed = []
    original = lms_torch._CallRecord._recompute_vjp

    def spy(self, grads):
        recomputed.append(type(self.unit).__name__)
        return original(self, grads)

    monkeypatch.setattr(lms_torch._CallRecord, "_recompute_vjp", spy)
    assert_matches(model, wrapped, np.random.default_rng(0).random((2, 8, 8, 3)).astype("float32"))
    stats = lms_torch.transfer_stats()
    assert stats["output_gradient_calls"] == 3
    assert recomputed.count("Activation") == 1 and recomputed.count("ReLU") == 1  # only the elu and the relu6
    assert stats["shared_swap_ins"] >= 3  # each activation re-used its consumer's swapped-in output


def test_structural_layers_run_plainly():
    model = models.unet2d()  # Concatenate skips
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    lms_torch.reset_transfer_stats()
    wrapped(torch.rand(2, 32, 32, 1), training=True).sum().backward()
    stats = lms_torch.transfer_stats()
    concat_calls = sum(e.layer_class == "Concatenate" for e in wrapped.lms_plan)
    assert concat_calls == 2 and stats["plain_calls"] == concat_calls
    assert stats["offloaded_calls"] == len(wrapped.lms_plan) - concat_calls


def test_calls_that_need_no_gradient_run_plainly():
    model = models.losses_and_frozen()  # frozen conv on the (constant) model input
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    lms_torch.reset_transfer_stats()
    wrapped(torch.rand(2, 16, 16, 3), training=True).sum().backward()
    # frozen_conv and frozen_bn: nothing requires grad; global average pooling: structural
    assert lms_torch.transfer_stats()["plain_calls"] == 3


def test_a_second_backward_pass_is_refused():
    model = models.cnn_bn_dropout()
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0)
    loss = wrapped(torch.rand(2, 16, 16, 3), training=True).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once|twice|released"):
        loss.backward()


# ------------------------------------------------------------------------------------------- planning
def test_planning_runs_on_meta_tensors():
    """Planning a 3D U-Net at 128^3 x 8 (~20 GiB of layer inputs, as much as this machine's RAM) takes seconds
    and allocates nothing (a real forward pass would need the memory and minutes)."""
    model = build_unet((128, 128, 128, 1), depth=3, base_filters=16)
    wrapped = keras_lms.wrap(model)
    start = time.perf_counter()
    plan = wrapped.plan(batch_size=8)
    assert time.perf_counter() - start < 20
    assert len(plan) == len(wrapped.lms_plan) and plan[1].shapes[0] == (8, 128, 128, 128, 16)
    assert sum(e.bytes for e in plan) > 16 * 2**30
    assert lms_torch.signature_of(torch.zeros(2, 3), {}) == (((2, 3), "float32"),)


@pytest.mark.parametrize("host_device", ["/CPU:0", "cpu", "CPU:0", "/device:CPU:0"])
def test_host_device_accepts_the_cpu(host_device):
    assert lms_torch.validate_host_device(host_device) == "/CPU:0"


@pytest.mark.parametrize("host_device, message", [("/GPU:0", "not a CPU device"), ("cuda", "not a CPU device"),
                                                  ("/CPU:1", "does not exist"), ("banana", "not a device string")])
def test_host_device_errors(host_device, message):
    with pytest.raises(ValueError, match=message):
        lms_torch.validate_host_device(host_device)
    with pytest.raises(ValueError, match=message):
        keras_lms.wrap(models.cnn_bn_dropout(), host_device=host_device)


def test_keras_lms_imports_no_tensorflow_under_torch():
    code = ("import sys, numpy as np, keras, keras_lms; from tests import models; "
            "m = models.cnn_bn_dropout(); w = keras_lms.wrap(m, min_bytes=0); "
            "w.compile(optimizer='sgd', loss='mse'); "
            "w.fit(np.zeros((4, 16, 16, 3), 'float32'), np.zeros((4, 3), 'float32'), verbose=0); "
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('tensorflow', 'tf_keras')); "
            "assert not bad, bad; print('ok')")
    env = dict(os.environ, KERAS_BACKEND="torch")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_cuda_stream_protocol_with_fake_streams(monkeypatch):
    """The CUDA branch of Transfer, run against recording fakes of streams and events (no GPU here): the copy
    stream waits for the compute stream before each copy, the device tensor read by a device-to-host copy is
    recorded on the copy stream, and the compute stream waits on the host-to-device copy's event before use."""
    import contextlib

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.stream))

    class FakeEvent:
        done = False

        def __init__(self):
            self.stream = None

        def record(self, stream):
            self.stream = stream.name
            log.append(("record_event", stream.name))

        def query(self):
            return self.done

        def synchronize(self):
            log.append(("synchronize", self.stream))

    compute, copy = FakeStream("compute"), FakeStream("copy")

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(("record_stream", stream.name)))
    pool = lms_torch.HostBufferPool(pin=False)
    transfer = lms_torch.Transfer(torch.device("cpu"), pool, copies=True)
    transfer.cuda, transfer.stream = True, copy
    x = torch.rand(4, 4, requires_grad=True) * 2
    host = transfer.to_host(x)
    assert log == [("wait_stream", "copy", "compute"), ("enter", "copy"), ("record_event", "copy"), ("exit", "copy"),
                   ("record_stream", "copy")]
    assert torch.equal(host.buffer, x.detach()) and not host.buffer.requires_grad
    # back-pressure: beyond MAX_INFLIGHT_BYTES of unfinished device-to-host copies the host waits for the oldest
    monkeypatch.setattr(lms_torch, "MAX_INFLIGHT_BYTES", 40)
    log.clear()
    transfer.to_host(torch.rand(2, 2))  # 64 + 16 bytes in flight > max(40, 2 x 16)
    assert log[-1] == ("synchronize", "copy") and transfer._inflight_bytes == 16
    FakeEvent.done = True  # finished copies are dropped without waiting
    transfer.to_host(torch.rand(2))
    assert transfer._inflight_bytes == 0
    log.clear()
    host.pending = 1
    swap = transfer.to_device(host)
    assert log == [("wait_stream", "copy", "compute"), ("enter", "copy"), ("record_event", "copy"), ("exit", "copy")]
    host.done(output_reader=False)
    assert pool.lent == 0  # the buffer is reusable once its copy is queued (same copy stream, FIFO)
    log.clear()
    assert torch.equal(swap.get(), x.detach())
    assert log == [("wait_event", "compute", "copy")]
    log.clear()
    unused = transfer.to_device(lms_torch._HostCopy(torch.ones(2), None, 8))
    log.clear()
    del unused  # a prefetched copy nobody read: the compute stream still orders after it
    gc.collect()
    assert log == [("wait_event", "compute", "copy")]


@pytest.mark.parametrize("name", ["multi_io", "nested", "unet2d"])
def test_releasing_graph_runs_give_identical_results(name):
    """_keras_adapter.releasing_graph_runs (a private-API shim over Function._run_through_graph) changes only
    when references are dropped, never the result (dict outputs, nested and repeated models, skips)."""
    from keras_lms import _keras_adapter as adapter
    from keras_lms import planning

    model = getattr(models, name)()
    rng = np.random.default_rng(0)
    if name == "multi_io":
        x = {"image": torch.tensor(rng.random((2, 16, 16, 3)), dtype=torch.float32),
             "meta": torch.tensor(rng.random((2, 5)), dtype=torch.float32)}
    else:
        shape = (2, 32, 32, 1) if name == "unet2d" else (2, 16, 16, 3)
        x = torch.tensor(rng.random(shape), dtype=torch.float32)
    expected = model(x, training=False)
    structure = planning.model_structure(model)
    with adapter.releasing_graph_runs(structure.models):
        assert all("_run_through_graph" in g.__dict__ for g in adapter._functional_graphs(structure.models))
        got = model(x, training=False)
    assert not any("_run_through_graph" in g.__dict__ for g in adapter._functional_graphs(structure.models))
    for a, b in zip(keras.tree.flatten(expected), keras.tree.flatten(got)):
        assert torch.equal(a, b)


def test_host_copy_keeps_the_original_memory_layout():
    """A channels-last permutation (what Keras' torch convolutions and pooling hand out) comes back with its own
    strides, so the backward pass sees the plain model's layout (a contiguous copy changed the summation order
    of a max pooling downstream: 1e-5 relative on DenseNet121, float32 and float64 alike). Negative control: a
    dense tensor keeps contiguous strides, and an overlapping view gets a contiguous buffer."""
    transfer = lms_torch.Transfer(torch.device("cpu"), pool=lms_torch.HostBufferPool(pin=False), copies=True)
    nchw = torch.rand(2, 3, 4, 5)
    nhwc_view = nchw.permute(0, 2, 3, 1)
    host = transfer.to_host(nhwc_view)
    back = transfer.to_device(host).get()
    assert back.stride() == nhwc_view.stride() != nhwc_view.contiguous().stride()
    assert torch.equal(back, nhwc_view)
    dense = torch.rand(2, 3)
    assert transfer.to_device(transfer.to_host(dense)).get().stride() == dense.stride()
    overlapping = torch.rand(3, 1).expand(3, 4)
    copy = transfer.to_device(transfer.to_host(overlapping)).get()
    assert copy.is_contiguous() and torch.equal(copy, overlapping)
