"""Run in a fresh process by test_upsampler_forward.py (the logical CPUs must be set before TensorFlow starts).

    python upsampler_forward_case.py EDGE

A wrapped float32 3D U-Net (two levels, every eligible tensor offloaded, in slabs) optimised by grappler for a
virtual GPU and replayed: the most bytes live at once during the level-0 up-sampler's forward, of that call's own
buffers (the layout optimiser's channels-first copies, the transposed convolution's output, its bias sum, the
result) and its input; beside the memory model's charge for the same position (the input, the output and
``forward_temporaries``) and the charge of both phases at once (the model before). Prints one JSON object.
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
from keras_lms import offload, planning  # noqa: E402
from keras_lms.offload.tensorflow import step_memory  # noqa: E402
from keras_lms.planning.memory_model import tensor_sizes  # noqa: E402
from keras_lms.testing import simulated_gpu  # noqa: E402

edge = int(sys.argv[1])
model = unet((edge, edge, edge, 1), 16, levels=2)
# every eligible tensor offloaded, in slabs as at the largest cubes: the layout optimiser then runs the
# up-sampler channels-first (with wrap's defaults at this size it runs channels-last, no copies)
wrapped = keras_lms.wrap(model, min_bytes=0, keep_last=0, slab_bytes="16MiB")
backend = offload.active_backend()
step = planning.plan_step(backend, model, wrapped.lms_structure, wrapped.lms_config,
                          backend.example_inputs(model, 1), {}, 1, None)
index = next(i for i, call in enumerate(step.calls) if call.unit.name == "up0_upconv")
call = step.calls[index]
sizes_in, sizes_out, _ = tensor_sizes(step.calls, 1)
offloaded = step.entries[index].offloaded
inputs, outputs = sum(sizes_in[index]), sum(sizes_out[index])
model_charge = inputs + outputs + step_memory.forward_temporaries(call, sizes_in[index], sizes_out[index], None,
                                                                   inputs if offloaded else 0)
both_phases = inputs + outputs + inputs + 2 * outputs  # the input's copy and two outputs beside the result

shape = (1, edge, edge, edge, 1)
buffers = simulated_gpu.executed_buffers(wrapped, shape, shape, "float32", "adam")
own = [b for b in buffers if "up0_upconv" in b.name and "gradient_tape" not in b.name]
reader = [b for b in buffers if "up1_relu2" in b.name and "Relu:" in b.name and "gradient_tape" not in b.name]
watched = own + reader
most = max(sum(b.size for b in watched if b.start <= t <= b.end) for t in sorted({b.start for b in own}))
print(json.dumps(dict(offloaded=bool(offloaded), inputs=inputs, outputs=outputs, executed=most,
                      model=model_charge, both_phases=both_phases, own=sorted(b.name for b in own),
                      layout_copies=sum("LayoutOptimizer" in b.name for b in own))))
