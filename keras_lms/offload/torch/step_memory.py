"""How a torch training step holds device memory: the planner's ``BackendFacts`` for this back end.

Measured with the live tensor storages of a step (benchmarks/torch_cpu_peak.py; the report is within 15% on
the U-Nets there, plain and wrapped):

* torch differentiates relu, sigmoid and tanh from their output (``threshold_backward`` etc.), elu from its input;
  average pooling's backward takes its input (``avg_pool*_backward``);
* autograd saves more than a layer's inputs: Keras' channels-last convolutions a copy of their input (and a
  channels-last copy of a 2D/3D kernel), normalization its centred input, dropout its mask, max pooling a
  channels-first copy of its input and int64 indices (``saved_extra_bytes``);
* a convolution's input gradient comes out channels-first and is copied back to Keras' layout;
* every offloaded call is recomputed in its backward, except the lean BatchNormalization and convolution calls
  (``lean_norm``, ``lean_conv``);
* with a device profile, a lean BatchNormalization's output (or the activation's after it) can be recomputed
  whole from the BatchNorm's input copy instead of copied (``recompute_candidates``);
* a prefetched copy back takes its device memory when the trigger's backward issues it (the copy's destination
  is allocated on the compute stream);
* the autograd engine sums a multiply-read tensor's gradient in its input buffer, a concatenation's input
  gradients are views of its output gradient, and a weight's gradient exists from its layer's backward on;
* Keras' functional model keeps every layer output until its forward pass returns (a wrapped model frees each
  after its last use);
* Keras' optimizers update all variables at once with ``torch._foreach_*`` ops: Adam-like updates hold three
  trainable-weight-sized temporaries (SGD none).

And for the step-time model, what torch's eager kernels move (``eager_bytes``; counted with a dispatch mode over
one training step of each layer, tests/offload/torch/test_eager_bytes.py, Keras 3.15 on torch 2.x): nothing is
fused, so Keras' BatchNormalization runs ~10 element-wise passes over its input forward and ~27 backward, Dropout
draws and scales its mask in three kernels, and a channels-last convolution or pooling copies its input to
channels-first and back (two strided copies; cuDNN then writes the input gradient in the input's layout, where the
CPU's 3D kernels copy it once more). On an H200 these strided copies took 22 of a plain 3D U-Net step's 100 ms, and
the element-wise passes 20 (docs/benchmarks.md).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_lms.offload.torch import recompute_candidates
from keras_lms.planning import BackendFacts, layer_facts
from keras_lms.planning.backend_facts import EagerBytes
from keras_lms.planning.memory_model import variable_bytes

# The lean normalisation's slabs (lean_norm.py reads them here): its float32 temporaries are one slab of
# max(LEAN_SLAB_ROWS, rows / LEAN_SLABS) rows (positions) x channels, at most the input.
LEAN_SLABS = 16
LEAN_SLAB_ROWS = 1 << 14

# Optimizers whose update keeps no weight-sized temporaries (measured: SGD with or without momentum).
LEAN_UPDATES = frozenset({"SGD"})
# Weight-sized temporaries of the other optimizers' updates (measured 3 for Adam, AdamW and RMSprop).
UPDATE_TEMPORARIES = 3


def lean_convolution_call(unit) -> bool:
    """Whether an offloaded call of ``unit`` is differentiated without recomputing it (lean_conv.py): Keras'
    own Conv2D/Conv3D ``call``, channels last, stride 1, dilation 1, one group, ``"valid"`` or ``"same"`` padding
    with odd kernel sizes, a linear activation, no LoRA. Its backward holds the input, a channels-last copy of
    the kernel, the gradients, and no recomputed output or input copy."""
    if type(unit) not in (keras.layers.Conv2D, keras.layers.Conv3D):
        return False
    same_ok = unit.padding == "valid" or (unit.padding == "same" and all(k % 2 for k in unit.kernel_size))
    return (unit.data_format == "channels_last" and all(s == 1 for s in unit.strides)
            and all(d == 1 for d in unit.dilation_rate) and getattr(unit, "groups", 1) == 1 and same_ok
            and layer_facts.activation_name(unit.activation) == "linear" and not getattr(unit, "lora_enabled", False))


def lean_normalization_call(unit, input_dtypes) -> bool:
    """Whether an offloaded call of ``unit`` is differentiated with the lean normalisation (lean_norm.py,
    ``LMSConfig.lean_normalization``): Keras' own BatchNormalization with batch statistics (trainable, no renorm,
    not synchronized), one input, not float64 (Keras on torch computes a float64 model's BatchNorm in float32,
    where the exact recompute is kept). Its backward holds the input, its gradient and the output's gradient,
    no recomputed output and no normalisation temporaries.
    """
    return (type(unit) is keras.layers.BatchNormalization and unit.trainable
            and not getattr(unit, "renorm", False) and not getattr(unit, "synchronized", False)
            and len(input_dtypes) == 1 and input_dtypes[0] != "float64")


def lean_normalization_temporary_bytes(input_shape, input_dtype, batch_size: int = 1) -> int:
    """Bytes of the lean normalisation's temporaries for an input of ``input_shape`` (the batch axis None or
    ``batch_size``), channels last: two float32 slabs, three when the input is narrower (the slab is cast first)."""
    dims = [batch_size if d is None else int(d) for d in input_shape]
    channels = max(dims[-1], 1)
    rows = 1
    for d in dims[:-1]:
        rows *= d
    slab_rows = min(rows, max(LEAN_SLAB_ROWS, -(-rows // LEAN_SLABS)))
    copies = 2 if str(input_dtype) in ("float32", "float64") else 3
    return copies * slab_rows * channels * 4


def kernel_copy_bytes(unit) -> int:
    """Keras' torch ``conv`` copies a 2D/3D kernel to channels-last memory (in the compute dtype), and autograd
    saves that copy with the input's (seen at the level-0 backward of a 3D U-Net: the copies of the
    bottleneck's kernels, kept since the forward pass, 17 MiB of 143)."""
    if not (layer_facts.is_keras_class(unit, {"Conv2D", "Conv3D"}) and layer_facts.runs_keras_kernel_call(unit)):
        return 0
    kernel = getattr(unit, "kernel", None)
    if kernel is None:
        return 0
    dtype = str(getattr(unit, "compute_dtype", None) or kernel.dtype).replace("bfloat16", "float16")
    return int(np.prod(kernel.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


# Bytes read plus written per pass, in units of the call's input bytes ``x`` and output bytes ``y`` (the census of
# tests/offload/torch/test_eager_bytes.py: each is what Keras 3.15's torch ops launch for one layer call).
BATCH_NORM_PASSES = (10, 27)  # forward (moments, normalise, a copy of x), backward (autograd of those ops)
DROPOUT_PASSES = (5, 3)  # bernoulli_ -> div_ -> mul; the backward multiplies by the mask
CHANNELS_LAST_COPIES = 2  # a conv's / pooling's input, permuted to channels-first, made contiguous, then back


def eager_bytes(call, x: int, y: int):
    """``TorchFacts.eager_bytes``: the bytes Keras' torch ops move for one call, or None for the generic count."""
    unit = call.unit
    if layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS):
        spatial = len(call.shapes[0]) >= 4 and getattr(unit, "data_format", "channels_last") == "channels_last"
        kernel = 2 * kernel_copy_bytes(unit)  # read and written
        channels = call.shapes[0][-1] or 1
        copies = 1 if "Transpose" in type(unit).__name__ else CHANNELS_LAST_COPIES
        forward_layout = (2 * copies * x if spatial and channels > 1 else 0) + kernel
        backward_layout = kernel  # cuDNN writes the input gradient channels-last, as the input (the CPU does not)
        bias = getattr(unit, "use_bias", False)
        activation = getattr(unit, "activation", None)
        activated = activation is not None and getattr(activation, "__name__", "") != "linear"
        forward = (2 * y if bias else 0) + (2 * y if activated else 0)
        backward = (y if bias else 0) + (3 * y if activated else 0)
        return EagerBytes(forward, backward, forward_layout, backward_layout)
    if type(unit) is keras.layers.BatchNormalization:  # Keras' own call (a subclass may compute otherwise)
        return EagerBytes(BATCH_NORM_PASSES[0] * x, BATCH_NORM_PASSES[1] * x)
    if layer_facts.is_keras_class(unit, layer_facts.MAX_POOLING_LAYERS):
        # read x, write y and int64 indices (2 y); backward: read dy and indices, write dx (zeroed, then scattered)
        layout = 2 * x if len(call.shapes[0]) >= 4 else 0
        return EagerBytes(x + 3 * y, 2 * x + 3 * y, layout, layout)
    if type(unit) is keras.layers.Dropout:
        return EagerBytes(DROPOUT_PASSES[0] * x, DROPOUT_PASSES[1] * x)
    return None


class TorchFacts(BackendFacts):
    """The torch back end's memory facts (see the module docstring)."""

    output_gradient_activations = frozenset({"relu", "sigmoid", "tanh"})
    recomputes_offloaded_calls = True
    copy_back_allocated_at_trigger = True
    concatenate_gradient_is_view = True
    gradients_wait_between_readers = True
    weight_gradients_from_their_backward = True
    plain_model_keeps_layer_outputs = True
    shared_copy_stream = True  # transfer.Transfer: one copy stream per device, both directions

    def eager_bytes(self, call, input_bytes: int, output_bytes: int):
        return eager_bytes(call, input_bytes, output_bytes)

    def backward_temporaries(self, unit, recomputed: bool = False, lean: bool = False) -> int:
        # A convolution's channels-first input gradient is copied to channels-last: one more, except in the
        # recompute of an offloaded call, where the swapped-in copy's gradient keeps its layout (what the
        # recompute re-creates instead is saved_extra_bytes).
        if layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS) and not recomputed:
            return 1
        return super().backward_temporaries(unit, recomputed, lean)

    def saved_extra_bytes(self, unit, input_bytes: int, output_bytes: int) -> int:
        if layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS | layer_facts.NORMALIZATION_LAYERS
                                      | layer_facts.DROPOUT_LAYERS):
            return input_bytes + kernel_copy_bytes(unit)
        if layer_facts.is_keras_class(unit, layer_facts.MAX_POOLING_LAYERS):
            return input_bytes + 2 * output_bytes  # the channels-first input copy, and one int64 index per output
        return 0

    def lean_normalization_call(self, unit, input_dtypes) -> bool:
        return lean_normalization_call(unit, input_dtypes)

    def lean_normalization_temporary_bytes(self, input_shape, input_dtype, batch_size: int = 1) -> int:
        return lean_normalization_temporary_bytes(input_shape, input_dtype, batch_size)

    def lean_convolution_call(self, unit) -> bool:
        return lean_convolution_call(unit)

    def lean_convolution_bytes(self, unit) -> int:
        return kernel_copy_bytes(unit)  # no recompute: the kernel's channels-last copy only

    def recompute_sources(self, calls, offloaded, slabs: dict, chains: dict, batch_size: int) -> dict:
        # whole tensors, not windows: torch computes no call in slabs (recompute_candidates)
        return recompute_candidates.recompute_sources(calls, offloaded, self, batch_size)

    def update_temporary_bytes(self, model, optimizer=None) -> int:
        # No optimizer (None) counts as Adam, Keras' usual choice; unknown optimizers count as Adam-like.
        if type(optimizer).__name__ in LEAN_UPDATES:
            return 0
        return UPDATE_TEMPORARIES * variable_bytes(model.trainable_variables)


FACTS = TorchFacts()


def memory_facts() -> TorchFacts:
    """The torch back end's ``BackendFacts`` (the back-end contract's ``memory_facts``)."""
    return FACTS
