"""Run in a fresh process by test_sweep_pieces.py (the logical CPUs must be set before TensorFlow starts).

    python sweep_pieces_case.py EDGE PIECES

A wrapped float32 3D U-Net (two levels, every eligible tensor offloaded, in slabs, every run swept with both units
held) optimised by grappler for a virtual GPU and replayed, with ``sweeps.GRADIENTS_IN_PIECES`` set to PIECES (1 or
0): the most bytes live at once while the level-0 decoder's sweep runs its passes (its ops are named
``lms_sweep_up0_*``), the step's peak beside the memory model's, and how many gradients between passes went on in
pieces (``slabs.gradient_token``). Prints one JSON object.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

from keras_lms.testing.logical_devices import configure_logical_cpus

configure_logical_cpus()

import keras_lms  # noqa: E402
from benchmarks.models import unet  # noqa: E402
from keras_lms.offload.tensorflow import slabs, sweeps  # noqa: E402
from keras_lms.testing import simulated_gpu  # noqa: E402

edge, pieces = int(sys.argv[1]), sys.argv[2] == "1"
sweeps.FORCED, sweeps.HELD_FORCED, sweeps.GRADIENTS_IN_PIECES = True, True, pieces
tokens = []
_token = slabs.gradient_token
slabs.gradient_token = lambda pieces: tokens.append(len(pieces)) or _token(pieces)

model = unet((edge, edge, edge, 1), 16, levels=2)
wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="4MiB")
report = keras_lms.report(wrapped, batch_size=1)
shape = (1, edge, edge, edge, 1)
buffers = simulated_gpu.executed_buffers(wrapped, shape, shape, "float32", "adam")
sweep_ops = [b for b in buffers if b.name.startswith("lms_sweep_up0_")]
times = sorted({b.start for b in sweep_ops} | {b.end for b in sweep_ops})
in_passes = max(sum(b.size for b in buffers if b.start <= t <= b.end) for t in times)
peak = max(sum(b.size for b in buffers if b.start <= t <= b.end) for t in sorted({b.start for b in buffers}))
swept = [r["layer"] for r in report.rows if "level sweep" in r["reason"]]
print(json.dumps(dict(pieces=pieces, in_passes=in_passes, peak=peak, tokens=len(tokens),
                      level0_bytes=4 * 16 * edge ** 3, swept=swept,
                      model_peak=report.totals["predicted_peak_bytes_wrapped"])))
