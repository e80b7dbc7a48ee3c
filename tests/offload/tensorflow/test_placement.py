"""Where activations live between forward and backward, read from the traced training-step graph."""

import re

import numpy as np
import pytest

import keras_lms
from tests import models
from tests.offload.tensorflow.graph_inspect import ancestors, base_name, trace_step

pytestmark = pytest.mark.tensorflow(reason="reads the traced tf.function graph")

RNG = np.random.default_rng(0)
UNET_X = RNG.random((2, 32, 32, 1)).astype("float32")


def device_resident_reads(step_graph):
    return [t for t in step_graph.backward_reads() if not (base_name(t.op).startswith("lms_swap_out")
                                                            and t.op.device.endswith("CPU:0"))]


@pytest.mark.parametrize("build,x", [
    (models.unet2d, UNET_X),
    (models.resnet_blocks, RNG.random((2, 16, 16, 3)).astype("float32")),
    (models.nested, RNG.random((2, 16, 16, 3)).astype("float32")),
    (models.subclassed, RNG.random((2, 16, 16, 3)).astype("float32")),
])
def test_backward_reads_only_host_copies(build, x):
    model = build()
    plain = trace_step(model, x)
    resident = device_resident_reads(plain)
    # Negative control: the same check on the plain model finds device-resident activations.
    assert len(resident) >= 3, [t.name for t in resident]

    wrapped = trace_step(keras_lms.wrap(model, min_bytes=0, keep_last=0), x)
    resident = device_resident_reads(wrapped)
    if build is models.subclassed:
        # Only the element-wise keras.ops (x + relu(...)) a subclassed call makes outside any layer remain.
        assert all(t.op.type in ("Relu", "AddV2") for t in resident), [(t.name, t.op.type) for t in resident]
    else:
        assert not resident, [(t.name, t.op.type, t.op.device) for t in resident]
    resident_names = {t.name for t in resident}
    host_reads = [t for t in wrapped.backward_reads() if t.name not in resident_names]
    assert len(host_reads) >= 3 and all(t.op.device.endswith("CPU:0") for t in host_reads)


def test_each_tensor_copied_to_host_once():
    """A U-Net skip tensor feeds a conv/pool and a concatenation: one host copy serves both."""
    step = trace_step(keras_lms.wrap(models.unet2d(), min_bytes=0, keep_last=0), UNET_X)
    sources = [op.inputs[0].name for op in step.ops_named("lms_swap_out")]
    assert sources and len(sources) == len(set(sources))
    consumers_per_copy = [len(op.outputs[0].consumers()) for op in step.ops_named("lms_swap_out")]
    assert max(consumers_per_copy) >= 2  # a skip tensor's copy is swapped in for two backward uses


def test_min_bytes_and_keep_last_leave_tensors_on_device():
    model = models.unet2d()
    x = UNET_X
    wrapped = keras_lms.wrap(model, min_bytes=16 * 1024, keep_last=3)
    step = trace_step(wrapped, x)
    plan = wrapped.lms_plan
    assert [e.offloaded for e in plan[-3:]] == [False] * 3
    assert all("keep_last" in e.reason for e in plan[-3:])
    small = [e for e in plan[:-3] if not e.offloaded]
    assert small and all("min_bytes" in e.reason for e in small)
    n_offloaded_tensors = sum(sum(e.tensor_offloaded) for e in plan)
    assert 0 < len(step.ops_named("lms_swap_out")) <= n_offloaded_tensors


def _swap_in_triggers(step):
    """call index of each gated host stage -> call index whose gradient arrival triggers it."""
    triggers = {}
    for op in step.ops_named("lms_swap_in"):
        match = re.fullmatch(r"lms_swap_in_(\d+)_host", base_name(op))
        if not match:
            continue
        marks = [c for c in op.control_inputs if base_name(c).startswith("lms_grad_arrival")]
        assert len(marks) == 1, (op.name, [c.name for c in op.control_inputs])
        own = int(match.group(1))
        triggers.setdefault(own, set()).add(int(re.match(r"lms_grad_arrival_(\d+)", base_name(marks[0])).group(1)))
    return triggers


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_swap_in_waits_for_backward_and_prefetches(prefetch):
    """The op that sends a host copy back is a host op gated on a backward gradient (prefetch calls ahead).

    The gate must sit on the host side: a control dependency on the device-side op after the transfer gates
    nothing (tests/offload/tensorflow/test_executed_graph.py checks this on the graph TensorFlow executes)."""
    model = models.cnn_bn_dropout()
    x = RNG.random((2, 16, 16, 3)).astype("float32")
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, prefetch=prefetch)
    step = trace_step(wrapped, x)
    backward = {op.name for op in step.backward_ops}
    swap_ins = [op for op in step.ops_named("lms_swap_in") if re.fullmatch(r"lms_swap_in_\d+", base_name(op))]
    assert swap_ins
    for op in swap_ins:
        assert op.name in backward
        # It cannot run before the backward pass: its ancestors include a backward op (the gradient arrival).
        assert any(name in backward for name in ancestors(op)), op.name
        stage = op.inputs[0].op
        assert re.fullmatch(r"lms_swap_in_\d+_host", base_name(stage)), stage.name
        assert stage.device.endswith("CPU:0") and stage.type != "Identity", (stage.device, stage.type)
        assert any(base_name(c).startswith("lms_grad_arrival") for c in stage.control_inputs), stage.name
    triggers = _swap_in_triggers(step)
    assert triggers
    n_calls = len(wrapped.lms_plan)
    for own, trig in triggers.items():
        expected = min(own + prefetch, n_calls - 1)
        assert trig == {expected}, (own, trig, prefetch)


def test_the_planned_prefetch_gates_the_swap_ins(planned_prefetch):
    """With device_profile and device_budget the planner may start copies back deeper than LMSConfig.prefetch
    (planning.prefetch_plan.plan_prefetch, tested in tests/planning/test_budget.py): the traced step must gate each
    swap-in on the gradient of the call the plan says. The plan is made to say 2 here; the config says 0."""
    planned_prefetch(2)
    model = models.cnn_bn_dropout()
    x = RNG.random((2, 16, 16, 3)).astype("float32")
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, prefetch=0)
    step = trace_step(wrapped, x)
    triggers = _swap_in_triggers(step)
    n_calls = len(wrapped.lms_plan)
    assert triggers and {e.prefetch for e in wrapped.lms_plan} == {2}
    assert all(trig == {min(own + 2, n_calls - 1)} for own, trig in triggers.items()), triggers


def test_a_call_with_its_own_lead_is_gated_on_that_calls_gradient(planned_leads):
    """A call whose copies back the planner starts earlier than the plan's depth (``PlanEntry.copy_back_lead``,
    ``planning.copy_back_leads``) is gated on the gradient of the call its lead names; the others keep the
    depth (the control: the same step without the leads gates every call one ahead)."""
    model = models.cnn_bn_dropout()
    x = RNG.random((2, 16, 16, 3)).astype("float32")
    control = _swap_in_triggers(trace_step(keras_lms.wrap(model, min_bytes=0, keep_last=0, prefetch=1), x))
    led = sorted(control)[:2]
    planned_leads({led[0]: 3, led[1]: 4})
    wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, prefetch=1)
    triggers = _swap_in_triggers(trace_step(wrapped, x))
    n_calls = len(wrapped.lms_plan)
    assert set(triggers) == set(control)
    for own, trig in triggers.items():
        lead = {led[0]: 3, led[1]: 4}.get(own, 1)
        assert trig == {min(own + lead, n_calls - 1)}, (own, trig, lead)
        assert control[own] == {min(own + 1, n_calls - 1)}
