"""The TensorFlow back end's output-based gradients: which units take their input gradient from their output,
and the kernels that compute it (the ones TensorFlow's own registered gradients emit)."""

from __future__ import annotations

import tensorflow as tf

from keras_lms.offload.tensorflow.step_memory import FACTS


def _output_gradient_fns():
    """activation name -> f(y, dy) giving d(activation)/d(input) * dy from the activation's output.

    These are the ops TensorFlow's own registered gradients of Relu/Sigmoid/Tanh/Elu emit, fed the same
    output tensor, and they are elementwise (no reduction whose order could differ). Checked bit-identical to
    the plain model in float32, with and without oneDNN, on inputs with exact zeros and near-ties
    (tests/offload/tensorflow/test_output_gradients.py). Only these four: keep a new entry only if that test
    shows it exact.
    Which layers qualify is this back end's memory fact (``step_memory.FACTS``), read by the planner too.
    """
    return {
        "relu": lambda y, dy: tf.raw_ops.ReluGrad(gradients=dy, features=y),
        "sigmoid": lambda y, dy: tf.raw_ops.SigmoidGrad(y=y, dy=dy),
        "tanh": lambda y, dy: tf.raw_ops.TanhGrad(y=y, dy=dy),
        "elu": lambda y, dy: tf.raw_ops.EluGrad(gradients=dy, outputs=y),
    }


def input_gradient_from_output(unit):
    """``fn(y, dy)`` giving d(unit)/d(input) * dy from the unit's output ``y``, or None.

    For the activation layers ``ReLU()`` and ``Activation("relu"|"sigmoid"|"tanh"|"elu")``, whose gradient
    TensorFlow itself computes from the op's output: using the output's host copy (the next layer's input)
    avoids the recompute and needs no input at all.

    Max pooling is recomputed instead (None). A standalone ``MaxPoolGrad``/``MaxPool3DGrad`` fed the host
    copies is not what the plain model runs: with oneDNN (TensorFlow's default on recent x86 CPUs) the plain
    graph pairs the forward pooling with its gradient through a workspace of argmax indices, while a lone
    gradient op runs another kernel. Measured against the plain model in float32: MaxPooling3D 0.7 relative
    gradient error on windows whose values differ by ~1e-7 (and above 1 on exact ties), MaxPooling2D with
    overlapping windows 5e-8. The recompute costs one pooling forward and reads only the input.
    """
    return _output_gradient_fns().get(FACTS.output_gradient_activation(unit))


def fused_activation_grad(unit):
    """The output-based activation gradient for ``unit``, or None when the trick does not apply.

    Only for Dense/Conv-family layers whose ``call`` is Keras' own (ends with ``self.activation(...)``), so a
    subclass that overrides ``call`` is always fully recomputed.
    """
    return _output_gradient_fns().get(FACTS.fused_output_activation(unit))


def reads_own_output(unit) -> bool:
    """Whether the unit's gradient can be taken from its output (fused activation or output-based layer)."""
    return fused_activation_grad(unit) is not None or input_gradient_from_output(unit) is not None
