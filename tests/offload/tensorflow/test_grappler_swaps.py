"""Grappler's own swaps in the simulator (issue 28): a GPU of the real size makes grappler swap, as TensorFlow does.

The simulator used to give grappler 1 TiB, so its memory optimizer never swapped and "plain Keras" meant a
TensorFlow that cannot swap. ``simulate(..., gpu_memory_bytes=)`` optimises for the real size: the memory
optimizer compares its estimate with it and inserts ``_CopyFromGpuToHost``/``_CopyFromHostToGpu`` pairs
(keras_lms/testing/grappler_swaps.py registers the ops so that the passes after it run), and the replay keeps
each host copy on the host and brings it back when grappler's trigger has run.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow(reason="grappler's memory optimizer rewrites the TensorFlow graph")

CASE = pathlib.Path(__file__).with_name("grappler_swaps_case.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # An empty cache: the swap-op library is compiled here, as on a machine that never ran the simulation.
    cache = tmp_path_factory.mktemp("keras_lms_cache")
    out = subprocess.run([sys.executable, str(CASE)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KERAS_LMS_CACHE": str(cache)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["compiled"] = sorted(p.name for p in (cache / "grappler-swap-ops").glob("*.so"))
    return result


def test_the_swap_ops_are_compiled_on_first_use(runs):
    assert len(runs["compiled"]) == 1 and runs["compiled"][0].startswith("swap_ops-"), runs["compiled"]


def test_grappler_swaps_when_its_estimate_exceeds_the_gpu(runs):
    unlimited, smaller = runs["unlimited"], runs["smaller"]
    assert unlimited["swaps"] == [] and unlimited["swap_bytes"] == 0, unlimited
    assert smaller["swaps"], smaller
    # every copy back waits for a trigger grappler chose in the backward pass, and reads one swapped tensor
    assert all(s["trigger"] and s["consumer"].startswith("gradient_tape/") for s in smaller["swaps"]), smaller
    assert smaller["swap_bytes"] == len(smaller["swaps"]) * runs["tensor_bytes"], smaller
    assert smaller["sent"] == smaller["received"] == smaller["swap_bytes"], smaller


def test_a_swapped_tensor_waits_on_the_host(runs):
    """The replay: the swapped activations are not on the GPU at the peak, which is lower by at most their size."""
    unlimited, smaller = runs["unlimited"], runs["smaller"]
    swapped = {s["tensor"] for s in smaller["swaps"]}
    assert not swapped & set(smaller["live"]), (swapped, smaller["live"])
    assert swapped & set(unlimited["live"]), (swapped, unlimited["live"])  # without swaps they were there
    saved = unlimited["peak"] - smaller["peak"]
    assert runs["tensor_bytes"] <= saved <= len(swapped) * runs["tensor_bytes"], (saved, swapped)


def test_control_no_swaps_when_the_estimate_fits(runs):
    """The estimate ``grappler_estimate`` reports is the one grappler decides by: 5% more memory, no swap."""
    larger = runs["larger"]
    assert larger["swaps"] == [] and larger["swap_bytes"] == 0, larger
    assert larger["peak"] == runs["unlimited"]["peak"], larger


def test_a_wrapped_step_runs_without_grappler_swaps(runs):
    """A wrapped model's train function runs with grappler's swapping pass off (``call_options``); the simulator
    optimises it so (``step_memory_optimization``): on a GPU 10% smaller than grappler's estimate of the wrapped
    step, no swap of grappler's; the control (``KEEP_GRAPPLER_SWAPS_OUT = False``) swaps."""
    assert runs["wrapped_smaller"]["swaps"] == [] and runs["wrapped_smaller"]["swap_bytes"] == 0, runs
    assert runs["wrapped_control"]["swaps"], runs["wrapped_control"]
