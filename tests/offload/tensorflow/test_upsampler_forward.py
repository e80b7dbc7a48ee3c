"""The memory model's charge for a whole float32 3D transposed convolution's forward (a U-Net's up-sampler),
against the graph grappler optimises for a virtual GPU (``upsampler_forward_case.py``, in a fresh process: the
logical CPUs must be set before TensorFlow starts).

The layout optimiser runs the up-sampler channels-first: its input's copy and the channels-first output, then the
bias sum and the transpose back. The model charged both phases at once, which put the 432^3 float32 default plan's
peak at the level-0 up-sampler's forward (16.95 GiB against 15.22 executed) and made ``device_budget="16GiB"``
refuse a cube that trains. Now ``step_memory.transposed_convolution_temporaries`` charges the larger phase, the
input freed where nothing later reads it. The control: the old charge is over what runs by more than 10%.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow(reason="grappler's layout optimiser rewrites the TensorFlow graph")

CASE = pathlib.Path(__file__).with_name("upsampler_forward_case.py")


@pytest.fixture(scope="module")
def upsampler():
    out = subprocess.run([sys.executable, str(CASE), "128"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_layout_optimiser_runs_the_upsampler_channels_first(upsampler):
    # (the premise: without its copies the charge would not apply; the input's copy and the transpose back)
    assert upsampler["offloaded"] and upsampler["layout_copies"] == 2, upsampler["own"]


def test_the_model_charges_what_the_upsampler_forward_holds(upsampler):
    # three outputs at once (channels-first output, bias sum, the transpose back), the input and its copy freed
    assert upsampler["executed"] == pytest.approx(3 * upsampler["outputs"], rel=0.02), upsampler
    assert upsampler["model"] == pytest.approx(upsampler["executed"], rel=0.05), upsampler


def test_both_phases_at_once_over_charge_it(upsampler):
    # the control: the charge before (the input's copy and two outputs beside the input and the result)
    assert upsampler["both_phases"] > 1.1 * upsampler["executed"], upsampler
