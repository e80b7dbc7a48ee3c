"""Measuring tools that the tests and the benchmarks share; the rest of keras_lms never imports this package.

Like `keras.src.testing` or `torch.testing`, this is what checks keras-lms, not part of what it does:

- `keras_lms.testing.simulated_gpu`: the device-memory peak of a TensorFlow training step as it would execute on
  a GPU, without a GPU (grappler's virtual cluster); `benchmarks/simulated_gpu_peak.py` and
  `tests/offload/tensorflow/test_simulated_peak.py` use it.
- `keras_lms.testing.logical_devices`: the split of the CPU into a host and a stand-in for the accelerator, which
  the simulation and the executed-graph tests (`tests/offload/tensorflow/executed_graph.py`) both trace on.

Every module imports TensorFlow inside its functions, so importing one costs nothing and does not start
TensorFlow (the logical devices must be configured before it starts).
"""
