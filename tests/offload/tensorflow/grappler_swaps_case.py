"""Run in a fresh process by test_grappler_swaps.py (the logical CPUs must be set before TensorFlow starts).

A chain of Dense layers whose activations dominate its peak, simulated three times: on a 1 TiB GPU (grappler
never swaps), on a GPU 10% smaller than grappler's own estimate of the step (its memory optimizer swaps), and on
one 5% larger (the control: it must not). Then the same chain wrapped (nothing offloaded), on a GPU 10% smaller
than grappler's estimate of the wrapped step: with its train function's options (``call_options``: grappler's
swaps kept out) and, as the control, with ``KEEP_GRAPPLER_SWAPS_OUT = False``. Prints one JSON object.
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
from benchmarks.simulated_gpu_peak import dense_chain  # noqa: E402
from keras_lms.offload.tensorflow import call_options  # noqa: E402
from keras_lms.testing import simulated_gpu  # noqa: E402

WIDTH, DEPTH, BATCH = 256, 12, 4096  # 4 MiB activations, 256 KiB weights


def summary(sim):
    return dict(peak=sim.peak_bytes, swaps=[dict(tensor=p.tensor, consumer=p.consumer, trigger=p.trigger)
                                            for p in sim.grappler_swaps],
                swap_bytes=sim.grappler_swap_bytes, sent=sim.gpu.sent_bytes, received=sim.gpu.received_bytes,
                live=[name for _, name in sim.gpu.live], estimate=sim.grappler_estimate_bytes)


model = dense_chain(WIDTH, DEPTH)
shape = (BATCH, WIDTH)
unlimited = simulated_gpu.simulate(model, shape, shape, optimizer=None, grappler_estimate=True)
estimate = unlimited.grappler_estimate_bytes
smaller = simulated_gpu.simulate(model, shape, shape, optimizer=None, gpu_memory_bytes=int(0.9 * estimate))
larger = simulated_gpu.simulate(model, shape, shape, optimizer=None, gpu_memory_bytes=int(1.05 * estimate))
wrapped = keras_lms.wrap(dense_chain(WIDTH, DEPTH), min_bytes="1GiB")  # (nothing offloaded: the plain step's graph)
wrapped_estimate = simulated_gpu.simulate(wrapped, shape, shape, optimizer=None,
                                          grappler_estimate=True).grappler_estimate_bytes
wrapped_smaller = simulated_gpu.simulate(wrapped, shape, shape, optimizer=None,
                                         gpu_memory_bytes=int(0.9 * wrapped_estimate))
call_options.KEEP_GRAPPLER_SWAPS_OUT = False
wrapped_control = simulated_gpu.simulate(wrapped, shape, shape, optimizer=None,
                                         gpu_memory_bytes=int(0.9 * wrapped_estimate))
print(json.dumps(dict(tensor_bytes=BATCH * WIDTH * 4, unlimited=summary(unlimited), smaller=summary(smaller),
                      larger=summary(larger), wrapped_smaller=summary(wrapped_smaller),
                      wrapped_control=summary(wrapped_control))))
