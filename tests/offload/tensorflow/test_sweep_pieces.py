"""The gradients between a level sweep's passes kept as window pieces (``sweeps.GRADIENTS_IN_PIECES``), in the graph
grappler optimises for a virtual GPU (``sweep_pieces_case.py``, in a fresh process: the logical CPUs must be set
before TensorFlow starts).

Concatenated, each gradient ``G_j`` was whole beside its own pieces at the end of the pass that made it and beside
the next gradient's pieces through the pass that read it, and pass A's upstream gradient was whole until its last
window: with both units of the 400^3 level-0 decoder held, pass A peaked at 15.5 GiB. In pieces, each is freed as
it is read. The control: the same step with ``GRADIENTS_IN_PIECES = False``. Numerics are the passes' own (the
pieces are the values the concatenation held): ``test_sweeps.py`` runs with the pieces.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tensorflow(reason="level sweeps are TensorFlow's")

CASE = pathlib.Path(__file__).with_name("sweep_pieces_case.py")


def run_case(pieces: bool) -> dict:
    out = subprocess.run([sys.executable, str(CASE), "64", "1" if pieces else "0"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cases():
    return {pieces: run_case(pieces) for pieces in (True, False)}


def test_both_level_zero_runs_are_swept_and_hand_their_gradients_on_in_pieces(cases):
    for case in cases.values():
        assert {"down0_conv1", "up0_conv1", "up0_relu2"} <= set(case["swept"]), case["swept"]
    # two runs of two units: G_2 after pass A and G_1 after pass B_2, each once
    assert cases[True]["tokens"] == 4 and cases[False]["tokens"] == 0


def test_the_decoder_passes_hold_less_in_pieces(cases):
    # the most bytes live while the level-0 decoder's passes run; the control holds about half a level-0 tensor
    # more (its gradients concatenated, pass A's upstream gradient whole to its last window)
    level0 = cases[True]["level0_bytes"]
    assert cases[True]["in_passes"] < cases[False]["in_passes"] - 0.3 * level0, cases


def test_the_memory_model_charges_what_the_pieces_hold(cases):
    # the report's peak against the executed step's (the control's model, charging whole gradients, is 13% over)
    case = cases[True]
    assert case["model_peak"] == pytest.approx(case["peak"], rel=0.1), case
    assert cases[False]["model_peak"] > case["model_peak"]
