"""The calls the torch back end does not recompute: activation layers take their gradient from their output,
structural layers whose gradient reads no activation run plainly."""

from __future__ import annotations

import keras
import torch

from keras_lms.offload.torch.step_memory import FACTS
from keras_lms.planning import layer_facts


def _output_gradient_fns():
    """activation name -> f(y, dy): its input gradient from its output, with torch's own kernels."""
    aten = torch.ops.aten
    return {
        "relu": lambda y, dy: aten.threshold_backward(dy, y, 0),
        "sigmoid": lambda y, dy: aten.sigmoid_backward(dy, y),
        "tanh": lambda y, dy: aten.tanh_backward(dy, y),
        # Not elu: torch's own elu gradient reads the input; elu_backward from the output is 1.2e-7 off.
    }


def input_gradient_from_output(unit):
    """For a relu/sigmoid/tanh activation layer, ``fn(y, dy)`` giving its input gradient; else None."""
    return _output_gradient_fns().get(FACTS.output_gradient_activation(unit))


def runs_plainly(unit, kwargs) -> bool:
    """Structural layers whose torch gradient keeps no activation (a mask turns pooling into a product)."""
    if not layer_facts.is_keras_class(unit, layer_facts.STRUCTURAL_LAYERS):
        return False
    return not any(isinstance(v, torch.Tensor) for v in keras.tree.flatten(kwargs))
