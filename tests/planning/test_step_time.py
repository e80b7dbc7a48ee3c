"""The step-time model on hand-built calls: FLOPs and bytes worked out by hand, the host-link traffic of a plan,
the copy timeline's overlap, and the device profiles (built-in ones, files, bad input)."""

from __future__ import annotations

import dataclasses
import json

import keras
import pytest

from keras_lms.planning import BackendFacts
from keras_lms.planning.call_costs import call_cost, kernel_flops
from keras_lms.planning.device_profile import DeviceProfile, builtin_profiles, load_profile
from keras_lms.planning.step_time import _Link, predict_step_time
from keras_lms.planning.traffic import link_traffic
from tests.planning.calls import raw_call

FACTS = BackendFacts()
MIB = 1 << 20


def profile(**changes) -> DeviceProfile:
    """A round-number device: 1 TFLOP/s, 1 TB/s element-wise, 1 GB/s each way (0.5 GB/s when both copy)."""
    base = DeviceProfile(name="round", description="round numbers", flops_per_second={"float32": 1e12},
                         elementwise_bytes_per_second=1e12, host_to_device_bytes_per_second=1e9,
                         device_to_host_bytes_per_second=1e9, host_to_device_concurrent_bytes_per_second=0.5e9,
                         device_to_host_concurrent_bytes_per_second=0.5e9)
    return dataclasses.replace(base, **changes)


def conv3d_call(key_in, key_out, edge=16, c_in=4, c_out=8):
    return raw_call(keras.layers.Conv3D(c_out, 3, padding="same", use_bias=False), [(key_in, (edge,) * 3 + (c_in,))],
                    [(key_out, (edge,) * 3 + (c_out,))])


# ---------------------------------------------------------------------------------------------- FLOPs
def test_kernel_flops_by_hand():
    conv = conv3d_call("x", "y", edge=16, c_in=4, c_out=8)
    assert kernel_flops(conv.unit, conv, batch_size=2) == 2 * (2 * 16**3) * 27 * 4 * 8
    up = raw_call(keras.layers.Conv3DTranspose(8, 2, strides=2), [("x", (8, 8, 8, 16))], [("y", (16, 16, 16, 8))])
    assert kernel_flops(up.unit, up) == 2 * 8**3 * 8 * 16 * 8  # every input position scatters a 2x2x2 window
    dense = raw_call(keras.layers.Dense(10), [("x", (7, 30))], [("y", (7, 10))])
    assert kernel_flops(dense.unit, dense, batch_size=3) == 2 * 3 * 7 * 30 * 10
    depthwise = raw_call(keras.layers.DepthwiseConv2D(3, padding="same"), [("x", (32, 32, 6))],
                         [("y", (32, 32, 6))])
    assert kernel_flops(depthwise.unit, depthwise) == 2 * 32 * 32 * 9 * 6
    relu = raw_call(keras.layers.ReLU(), [("x", (1000,))], [("y", (1000,))])
    assert kernel_flops(relu.unit, relu) == 0


def test_call_costs_count_kernels_in_flops_and_the_rest_in_bytes():
    conv = call_cost(conv3d_call("x", "y"))
    assert conv.backward_flops == 2 * conv.forward_flops and conv.forward_bytes == 0
    bn = call_cost(raw_call(keras.layers.BatchNormalization(), [("x", (1000,))], [("y", (1000,))]))
    assert bn.forward_flops == 0 and bn.forward_bytes == 3 * 4000  # statistics, normalise, write
    reshape = call_cost(raw_call(keras.layers.Reshape((10, 100)), [("x", (1000,))], [("y", (10, 100))]))
    assert reshape.forward_bytes == 0  # metadata only


# ---------------------------------------------------------------------------------------------- traffic
def chain():
    """conv -> relu -> conv: the relu's gradient reads its output, which the second conv's copy brings back."""
    return [conv3d_call("x", "c1", c_in=1, c_out=4),
            raw_call(keras.layers.ReLU(), [("c1", (16, 16, 16, 4))], [("r1", (16, 16, 16, 4))]),
            conv3d_call("r1", "y", c_in=4, c_out=4)]


class OutputReadingFacts(BackendFacts):
    output_gradient_activations = frozenset({"relu"})


def test_traffic_counts_each_copy_out_once_and_each_reading_backward():
    calls = chain()
    facts = OutputReadingFacts()
    size = 16**3 * 4 * 4
    traffic = link_traffic(calls, [[True], [True], [True]], facts)
    # x (a quarter of size) and r1 go out; c1 is copied by the relu's call but no backward reads it
    assert traffic.out_bytes == [size // 4, 0, size]
    # the relu reuses the second conv's copy back of r1 (its first reader's, whole)
    assert traffic.backward_in_bytes == [size // 4, 0, size]
    only_relu = link_traffic(calls, [[False], [True], [True]], facts)
    assert only_relu.total_bytes == 2 * size
    # a back end whose relu gradient reads its input: c1 goes out and comes back too (a control for the facts)
    assert link_traffic(calls, [[True], [True], [True]], FACTS).total_bytes == 2 * (size // 4 + 2 * size)


def test_a_tensor_read_by_two_backwards_comes_back_twice():
    a = conv3d_call("x", "s", c_in=4, c_out=4)
    b = conv3d_call("s", "y1", c_in=4, c_out=4)
    c = conv3d_call("s", "y2", c_in=4, c_out=4)
    traffic = link_traffic([a, b, c], [[False], [True], [True]], FACTS)
    size = 16**3 * 4 * 4
    assert traffic.device_to_host_bytes == size and traffic.host_to_device_bytes == 2 * size


# ---------------------------------------------------------------------------------------------- timeline
def test_plain_step_is_its_compute_and_nothing_else():
    calls = chain()
    t = predict_step_time(calls, [[False]] * 3, FACTS, profile())
    flops = sum(call_cost(c).forward_flops * 3 for c in calls)
    relu = call_cost(calls[1])
    expected = flops / 1e12 + (relu.forward_bytes + relu.backward_bytes) / 1e12
    assert t.step_seconds == pytest.approx(expected) and t.compute_seconds == pytest.approx(expected)
    assert t.exposed_seconds == 0 and t.recompute_seconds == 0 and t.device_to_host_bytes == 0


def test_a_slow_link_is_exposed_and_a_fast_one_is_hidden():
    calls, offloaded = chain(), [[True], [True], [True]]
    slow = predict_step_time(calls, offloaded, FACTS, profile())
    fast = predict_step_time(calls, offloaded, FACTS, profile(
        host_to_device_bytes_per_second=1e15, device_to_host_bytes_per_second=1e15,
        host_to_device_concurrent_bytes_per_second=1e15, device_to_host_concurrent_bytes_per_second=1e15))
    assert fast.exposed_seconds == pytest.approx(0, abs=1e-9)
    assert slow.exposed_seconds > 10 * slow.compute_seconds  # 64 KiB-sized copies at 1 GB/s vs microseconds
    # the step cannot be shorter than the copies back it waits for
    assert slow.step_seconds >= slow.host_to_device_bytes / 1e9
    assert slow.step_seconds == pytest.approx(slow.compute_seconds + slow.recompute_seconds + slow.exposed_seconds)
    # call by call: the waits add up to the exposed time, and a fast link leaves none
    assert len(slow.call_waits) == len(calls) and sum(slow.call_waits) == pytest.approx(slow.exposed_seconds)
    assert all(w > 0 for w in slow.call_waits[:2]) and sum(fast.call_waits) == pytest.approx(0, abs=1e-9)


def test_prefetch_hides_a_copy_behind_a_later_calls_backward():
    # A long convolution's backward (1 s) hides the copy back of the input of the call before it (0.1 s) when
    # that copy is triggered one call early; without prefetch the copy waits for its own call.
    calls = [raw_call(keras.layers.ReLU(), [("x", (1000,))], [("y", (1000,))]),
             raw_call(keras.layers.Dense(1000), [("y", (1000,))], [("z", (1000,))])]
    slow = profile(flops_per_second={"float32": 6e6}, host_to_device_bytes_per_second=4e4,
                   device_to_host_bytes_per_second=1e12, host_to_device_concurrent_bytes_per_second=4e4,
                   device_to_host_concurrent_bytes_per_second=1e12)
    facts = BackendFacts()  # relu differentiated from its input: its backward reads x
    ahead = predict_step_time(calls, [[True], [False]], facts, slow, prefetch=1)
    late = predict_step_time(calls, [[True], [False]], facts, slow, prefetch=0)
    assert ahead.exposed_seconds == pytest.approx(0, abs=1e-6)
    assert late.exposed_seconds == pytest.approx(4000 / 4e4, rel=1e-3)
    # the wait is the ReLU's: its input's copy, not the Dense call, holds the step up
    assert late.call_waits[0] == pytest.approx(late.exposed_seconds) and late.call_waits[1] == 0


def test_both_directions_busy_use_the_concurrent_rates():
    # Two independent copies, one each way (TensorFlow's slab windows can come back during the forward while
    # copies go out): on a link that halves each direction's rate when both copy, both take twice as long.
    # The control: a link whose concurrent rates equal its solo rates.
    shared = _Link(profile())  # 1 GB/s alone, 0.5 GB/s each when both copy
    shared.issue("out", 1e9, "a")
    shared.issue("in", 1e9, "b back")
    assert shared.completion("a") == pytest.approx(2.0) and shared.completion("b back") == pytest.approx(2.0)
    same = _Link(profile(host_to_device_concurrent_bytes_per_second=1e9,
                         device_to_host_concurrent_bytes_per_second=1e9))
    same.issue("out", 1e9, "a")
    same.issue("in", 1e9, "b back")
    assert same.completion("b back") == pytest.approx(1.0)


def test_a_copy_back_waits_for_its_copy_out():
    # One tensor x goes out in the first call's forward; the backward that reads it brings it back. With a slow
    # device-to-host link, the copy back cannot start before x is on the host: the step is at least the copy
    # out plus the copy back, however early the prefetch asks for it.
    calls = [conv3d_call("x", "c1", c_in=4, c_out=4), conv3d_call("c1", "y", c_in=4, c_out=4)]
    offloaded = [[True], [False]]
    traffic = link_traffic(calls, offloaded, FACTS)
    assert traffic.backward_after == [(0,), ()]  # call 0's copy back reads what call 0 copied out
    size = traffic.out_bytes[0]
    slow_out = profile(device_to_host_bytes_per_second=1e6, device_to_host_concurrent_bytes_per_second=1e6,
                       host_to_device_bytes_per_second=1e9, host_to_device_concurrent_bytes_per_second=1e9)
    t = predict_step_time(calls, offloaded, FACTS, slow_out, prefetch=1)
    assert t.step_seconds >= size / 1e6 + size / 1e9


def test_the_link_orders_copies_by_their_dependencies_and_streams():
    rates = profile(host_to_device_concurrent_bytes_per_second=1e9, device_to_host_concurrent_bytes_per_second=1e9)
    # a copy back that reads a copy out starts when it ends; the control: an independent one starts at once
    link = _Link(rates)
    link.issue("out", 1e9, "a")
    link.issue("in", 1e9, "a back", after=["a"])
    assert link.completion("a back") == pytest.approx(2.0)
    link = _Link(rates)
    link.issue("out", 1e9, "a")
    link.issue("in", 1e9, "b back")
    assert link.completion("b back") == pytest.approx(1.0)
    # one stream for both directions (torch): the independent copy waits its turn
    link = _Link(rates, shared=True)
    link.issue("out", 1e9, "a")
    link.issue("in", 1e9, "b back")
    assert link.completion("b back") == pytest.approx(2.0)
    assert link.busy == {"in": pytest.approx(1.0), "out": pytest.approx(1.0)}
    # a copy waiting for one never issued is a bug in the schedule, reported as such
    link = _Link(rates)
    link.issue("in", 1e9, "orphan", after=["never"])
    with pytest.raises(RuntimeError, match="never issued"):
        link.completion("orphan")


def test_convolution_rates_by_channel_count():
    table = profile(convolution_flops_per_second={"float32": {"16": 2e12, "64": 8e12}})
    assert table.flops_rate("float32") == 1e12  # no channel count: the flat rate
    assert table.flops_rate("float32", 8) == 2e12 and table.flops_rate("float32", 128) == 8e12  # held at the ends
    assert table.flops_rate("float32", 32) == pytest.approx(4e12)  # log-log between 16 and 64
    assert table.flops_rate("float16", 32) == 1e12  # no table for the dtype: the flat float32 rate
    wide = conv3d_call("x", "y", c_in=4, c_out=16)
    cost = call_cost(wide)
    assert cost.channels == 16  # the larger of the two
    slow = profile(convolution_flops_per_second={"float32": {"16": 0.5e12}})
    flat = predict_step_time([wide], [[False]], FACTS, profile()).compute_seconds
    assert predict_step_time([wide], [[False]], FACTS, slow).compute_seconds == pytest.approx(2 * flat)
    with pytest.raises(ValueError, match="convolution_flops_per_second"):
        profile(convolution_flops_per_second={"float32": {"sixteen": 1e12}})
    with pytest.raises(ValueError, match="convolution_flops_per_second"):
        profile(convolution_flops_per_second={"float32": {}})


class LayoutCopyingFacts(BackendFacts):
    def eager_bytes(self, call, input_bytes, output_bytes):
        from keras_lms.planning.backend_facts import EagerBytes

        return EagerBytes(0, 0, 4 * input_bytes, 2 * input_bytes)


def test_layout_copies_run_at_their_own_rate():
    conv = conv3d_call("x", "y", c_in=4, c_out=4)
    x = call_cost(conv).forward_flops / (2 * 27 * 4)  # input elements
    copying = call_cost(conv, facts=LayoutCopyingFacts())
    assert copying.forward_layout_bytes == 4 * 4 * x and copying.forward_flops == call_cost(conv).forward_flops
    base = predict_step_time([conv], [[False]], FACTS, profile()).compute_seconds
    at_elementwise = predict_step_time([conv], [[False]], LayoutCopyingFacts(), profile()).compute_seconds
    assert at_elementwise == pytest.approx(base + 6 * 4 * x / 1e12)  # 0: the element-wise rate
    slow = profile(layout_copy_bytes_per_second=0.25e12)
    assert (predict_step_time([conv], [[False]], LayoutCopyingFacts(), slow).compute_seconds
            == pytest.approx(base + 6 * 4 * x / 0.25e12))
    with pytest.raises(ValueError, match="layout_copy_bytes_per_second"):
        profile(layout_copy_bytes_per_second=-1.0)


# ---------------------------------------------------------------------------------------------- profiles
def test_builtin_profiles_load_and_name_a_source_for_every_number():
    assert {"a100-pcie4", "h100-pcie5", "h200-pcie5", "gh200"} <= set(builtin_profiles())
    for name in builtin_profiles():
        p = load_profile(name)
        numbers = {f.name for f in dataclasses.fields(DeviceProfile) if getattr(p, f.name) not in ({}, None, 0, 0.0)}
        numbers -= {"name", "description", "sources"}
        assert numbers <= set(p.sources), (name, numbers - set(p.sources))
    h100 = load_profile("h100-pcie5")  # issue 26's acceptance profile
    assert (h100.host_to_device_bytes_per_second, h100.device_to_host_bytes_per_second) == (35e9, 50e9)
    assert h100.host_to_device_concurrent_bytes_per_second == 25e9 and h100.flops_rate("float16") == 200e12


def test_a_profile_file_round_trips(tmp_path):
    path = tmp_path / "mine.json"
    load_profile("gh200").save(path)
    assert load_profile(str(path)) == load_profile("gh200")


def test_bad_profiles_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in profile"):
        load_profile("h100-pcie7")
    with pytest.raises(TypeError, match="built-in profile name"):
        load_profile(3.5)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON.*keras-lms calibrate"):
        load_profile(str(broken))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"name": "x", "description": "y", "flops": 1}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['flops'\].*missing field"):
        load_profile(str(partial))
    with pytest.raises(ValueError, match="host_to_device_bytes_per_second = -1"):
        profile(host_to_device_bytes_per_second=-1)
    with pytest.raises(ValueError, match="float32"):
        profile(flops_per_second={"float16": 1e12})
