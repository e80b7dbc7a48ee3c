"""benchmarks/xla_live_peak.py reads an XLA dump's device-only peak: host buffers (memory space S(5), color 5),
which XLA's own live-range "peak" ranks with the device's, are left out, and a value's live range is matched to
its buffer whether it is a tuple element ("name{0}") or not ("name{}" in the live ranges, "name" in the buffer
assignment). A synthetic dump in the format XLA 0.10 writes (the 3D U-Net's real one: docs/jax_findings.md)."""

from __future__ import annotations

from benchmarks import xla_live_peak

ASSIGNMENT = """\
allocation 0: size 400, parameter 0, shape |f32[100]| at ShapeIndex {}:
 value: <1 x.1 @0> (size=400,offset=0): f32[100]{0}
allocation 1: size 1000, maybe-live-out:
 value: <2 conv.1{0} @0> (size=1000,offset=0): f32[250]{0}
allocation 2: size 5000, color 5:
 value: <4 copy-start.1{0} @0> (size=5000,offset=0): f32[1250]{0:S(5)}
allocation 3: size 800:
 value: <3 fusion.2 @0> (size=600,offset=200): f32[150]{0}
 value: <5 dus.3 @0> (size=600,offset=200): f32[150]{0}
"""

LIVE_RANGES = """\
HloLiveRange (max 4):
  InstructionSequence:
    0:x.1
    1:conv.1
    2:copy-start.1
    3:fusion.2
    4:dus.3
    5:root
  BufferLiveRange:
    x.1{}:0-4
    conv.1{0}:1-2
    copy-start.1{0}:2-4
    fusion.2{}:2-4
    dus.3{}:4-5
  Live ranges at 2 (peak):
    copy-start.1{0}: 5000 bytes (cumulative: 5000 bytes)
"""


def _dump(tmp_path):
    (tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations-buffer-assignment.txt").write_text(ASSIGNMENT)
    (tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations-live-range.txt").write_text(LIVE_RANGES)
    buffers = xla_live_peak.device_buffers(
        tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations-buffer-assignment.txt")
    sequence, ranges = xla_live_peak.live_ranges(
        tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations-live-range.txt")
    return buffers, sequence, ranges


def test_the_device_peak_leaves_host_buffers_out(tmp_path):
    buffers, sequence, ranges = _dump(tmp_path)
    assert "copy-start.1{0}" not in buffers and set(buffers) == {"x.1", "conv.1{0}", "fusion.2", "dus.3"}
    peak, at, there = xla_live_peak.device_peak(buffers, sequence, ranges)
    assert (peak, at, sequence[at]) == (400 + 1000 + 600, 2, "copy-start.1")
    assert [name for _, name, _, _ in there] == ["conv.1{0}", "fusion.2", "x.1"]
    # the control: with the host buffer counted (as XLA's own live-range peak does) the peak is another
    everything = dict(buffers, **{"copy-start.1{0}": (5000, "f32[1250]{0:S(5)}", (2, 0))})
    assert xla_live_peak.device_peak(everything, sequence, ranges)[0] == 7000


def test_an_in_place_update_counts_its_memory_once(tmp_path):
    """dus.3 writes into fusion.2's buffer (one slot: allocation 3, offset 200) and is defined where fusion.2 is
    last read: at instruction 4 that memory holds 600 bytes, not 1200."""
    buffers, sequence, _ = _dump(tmp_path)
    assert buffers["fusion.2"][2] == buffers["dus.3"][2] == (3, 200)
    ranges = {"x.1": (0, 5), "fusion.2": (2, 4), "dus.3": (4, 5)}
    assert xla_live_peak.device_peak(buffers, sequence, ranges)[0] == 400 + 600
    # the control: the same two values in separate slots count twice at 4
    apart = dict(buffers, **{"dus.3": (600, "f32[150]{0}", (4, 0))})
    assert xla_live_peak.device_peak(apart, sequence, ranges)[:2] == (400 + 1200, 4)


def test_main_prints_the_table(tmp_path, capsys):
    _dump(tmp_path)
    assert xla_live_peak.main([str(tmp_path), "--module", "jit_step"]) == 0
    assert "instruction 2" in capsys.readouterr().out
