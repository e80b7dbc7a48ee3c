"""What a layer's gradient reads: one table of facts that the planner, the report and both back ends share.

Every fact here is about Keras' own layer classes (a subclass may override ``call`` and is then treated as an
arbitrary layer), and about how the frameworks differentiate them:

* structural layers (Add, Concatenate, reshapes, padding, cropping, global average pooling; average pooling on
  TensorFlow) need no tensor values for their gradient: the backward keeps nothing of them;
* relu/sigmoid/tanh/elu gradients are functions of the activation's *output*: a standalone activation layer
  keeps only its output, and a Dense/Conv-family layer with such a fused activation keeps its output too;
* max pooling reads its input and its output;
* normalization gradients hold a few input-sized temporaries (measured on TensorFlow's executed graph).

Back ends decide which of these facts they can exploit (their own kernel tables); this module only says what
is true of the layers.
"""

from __future__ import annotations

import keras

STRUCTURAL_LAYERS = frozenset({
    "Add", "Subtract", "Concatenate", "Average", "Flatten", "Reshape", "Permute", "RepeatVector", "Identity",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
})
# TensorFlow's AvgPool gradient reads only the input's shape; torch's autograd saves the input itself
# (avg_pool*_backward takes it), so on torch average pooling keeps its input like any layer.
AVERAGE_POOLING_LAYERS = frozenset({"AveragePooling1D", "AveragePooling2D", "AveragePooling3D"})
# Activations whose gradient the framework computes from the activation's *output* (its registered gradient
# reads the output, not the input): TensorFlow's Relu/Sigmoid/Tanh/Elu gradients; torch's relu/sigmoid/tanh
# (torch's elu_backward is given the input). Both back ends' output-based kernels and the planner read this.
OUTPUT_GRADIENT_ACTIVATIONS = {
    "tensorflow": frozenset({"relu", "sigmoid", "tanh", "elu"}),
    "torch": frozenset({"relu", "sigmoid", "tanh"}),
}
MAX_POOLING_LAYERS = frozenset({"MaxPooling1D", "MaxPooling2D", "MaxPooling3D"})
NORMALIZATION_LAYERS = frozenset({"BatchNormalization", "LayerNormalization", "GroupNormalization"})
KERNEL_LAYERS = frozenset({
    "Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
    "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D",
})
CONV_LAYERS = KERNEL_LAYERS - {"Dense", "EinsumDense"}
DROPOUT_LAYERS = frozenset({"Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                            "GaussianDropout", "AlphaDropout"})
# Input-sized temporaries the gradient of a normalization layer holds besides its input gradient (measured on
# the executed graph: BatchNormalization's backward holds dy, x, dx and three more tensors of x's size; the
# torch live-storage peaks agree within 15% with the same number).
NORMALIZATION_TEMPORARIES = 3


def is_keras_class(unit, names) -> bool:
    """``unit`` is an instance of one of Keras' own classes called ``names`` (not a user subclass)."""
    cls = type(unit)
    return cls.__name__ in names and cls.__module__.startswith("keras.")


def _activation_name(fn) -> str:
    """Keras' name of ``fn`` when it is one of Keras' own relu-like/linear activations (by identity, so a
    user function that happens to be called ``relu`` is not mistaken for it), else ''."""
    acts = keras.activations
    known = {acts.relu: "relu", acts.sigmoid: "sigmoid", acts.tanh: "tanh", acts.elu: "elu", acts.linear: "linear"}
    try:
        return known.get(fn, "")
    except TypeError:  # an unhashable callable
        return ""


def is_plain_relu(unit) -> bool:
    """A ``keras.layers.ReLU`` that is exactly ``max(x, 0)`` (no cap, slope or threshold)."""
    return (type(unit) is keras.layers.ReLU and not unit.max_value and not unit.negative_slope
            and not unit.threshold)


def output_gradient_activation(unit, backend: str | None = None) -> str | None:
    """For a standalone activation layer whose gradient ``backend`` computes from its output, the activation's
    name (``backend`` defaults to Keras' current back end).

    ``ReLU()`` without options and ``Activation(name)`` for a name in ``OUTPUT_GRADIENT_ACTIVATIONS[backend]``;
    None for anything else.
    """
    allowed = OUTPUT_GRADIENT_ACTIVATIONS[backend or keras.backend.backend()]
    if type(unit) is keras.layers.Activation:
        name = _activation_name(unit.activation)
        return name if name in allowed else None
    return "relu" if is_plain_relu(unit) else None


def fused_output_activation(unit, backend: str | None = None) -> str | None:
    """For a Dense/Conv-family layer running Keras' own ``call`` with a relu-like fused activation, its name.

    Only Keras' own ``call`` ends with ``self.activation(...)``; a subclass that overrides ``call`` gets None
    (a subclass that keeps Keras' ``call`` counts).
    """
    if not runs_keras_kernel_call(unit):
        return None
    name = _activation_name(getattr(unit, "activation", None))
    return name if name in OUTPUT_GRADIENT_ACTIVATIONS[backend or keras.backend.backend()] else None


def _kernel_classes():
    return tuple(getattr(keras.layers, name) for name in sorted(KERNEL_LAYERS) if hasattr(keras.layers, name))


def runs_keras_kernel_call(unit) -> bool:
    """An instance of a Dense/Conv-family class (or a subclass) whose ``call`` is Keras' own."""
    classes = _kernel_classes()
    return isinstance(unit, classes) and type(unit).call in {cls.call for cls in classes}


def is_linear_activation(unit) -> bool:
    return type(unit) is keras.layers.Activation and _activation_name(unit.activation) == "linear"


def keeps_no_activation(unit, backend: str | None = None) -> bool:
    """The unit's gradient reads no tensor values (only shapes): structural layers, linear activations, and
    on TensorFlow average pooling. ``backend`` defaults to Keras' current back end."""
    backend = backend or keras.backend.backend()
    if is_keras_class(unit, STRUCTURAL_LAYERS) or is_linear_activation(unit):
        return True
    return backend == "tensorflow" and is_keras_class(unit, AVERAGE_POOLING_LAYERS)


def backward_reads(unit, backend: str | None = None) -> tuple:
    """``(reads_inputs, reads_output)`` of the unit's gradient as the framework differentiates it (plain model).

    Structural layers need no tensor values; relu-like activation layers need their output, not their input;
    max pooling and Dense/Conv-family layers with a fused relu-like activation need both. Everything else is
    assumed to need its inputs (the conservative choice).
    """
    if keeps_no_activation(unit, backend):
        return False, False
    if output_gradient_activation(unit, backend) is not None:
        return False, True
    if is_keras_class(unit, MAX_POOLING_LAYERS) or fused_output_activation(unit, backend) is not None:
        return True, True
    return True, False


def backward_temporaries(unit, backend: str | None = None, recomputed: bool = False, lean: bool = False) -> int:
    """Input-sized temporaries the call's gradient holds besides the gradients of its inputs and outputs.

    Normalization: three on both back ends, none for torch's lean normalisation (``lean``: see
    :func:`lean_normalization_call`). On torch a convolution's input gradient comes out channels-first and is
    copied to Keras' channels-last layout: one more, except in keras-lms' recompute of an offloaded call, where
    the input gradient of the swapped-in copy keeps its layout (what the recompute re-creates instead, e.g. the
    convolution's copy of its input, is :func:`saved_extra_bytes`).
    """
    backend = backend or keras.backend.backend()
    if is_keras_class(unit, NORMALIZATION_LAYERS):
        return 0 if lean else NORMALIZATION_TEMPORARIES
    if backend == "torch" and is_keras_class(unit, CONV_LAYERS) and not recomputed:
        return 1
    return 0


# The torch lean normalisation's slabs (keras_lms/offload/torch/lean_norm.py reads them here): its float32
# temporaries are one slab of max(LEAN_SLAB_ROWS, rows / LEAN_SLABS) rows (positions) x channels, at most the input.
LEAN_SLABS = 16
LEAN_SLAB_ROWS = 1 << 14


def lean_normalization_temporary_bytes(input_shape, input_dtype, batch_size: int = 1) -> int:
    """Bytes of the torch lean normalisation's temporaries for an input of ``input_shape`` (the batch axis
    None or ``batch_size``), channels last: two float32 slabs, three when the input is narrower (the slab is
    cast first)."""
    dims = [batch_size if d is None else int(d) for d in input_shape]
    channels = max(dims[-1], 1)
    rows = 1
    for d in dims[:-1]:
        rows *= d
    slab_rows = min(rows, max(LEAN_SLAB_ROWS, -(-rows // LEAN_SLABS)))
    copies = 2 if str(input_dtype) in ("float32", "float64") else 3
    return copies * slab_rows * channels * 4


def lean_convolution_call(unit, backend: str | None = None) -> bool:
    """Whether the torch back end differentiates an offloaded call of ``unit`` without recomputing it
    (keras_lms/offload/torch/lean_conv.py): Keras' own Conv2D/Conv3D ``call``, channels last, stride 1,
    dilation 1, one group, ``"valid"`` or ``"same"`` padding with odd kernel sizes, a linear activation, no
    LoRA. Its backward holds the input, a channels-last copy of the kernel, the gradients, and no recomputed
    output or input copy."""
    backend = backend or keras.backend.backend()
    if backend != "torch" or type(unit) not in (keras.layers.Conv2D, keras.layers.Conv3D):
        return False
    same_ok = unit.padding == "valid" or (unit.padding == "same" and all(k % 2 for k in unit.kernel_size))
    return (unit.data_format == "channels_last" and all(s == 1 for s in unit.strides)
            and all(d == 1 for d in unit.dilation_rate) and getattr(unit, "groups", 1) == 1 and same_ok
            and _activation_name(unit.activation) == "linear" and not getattr(unit, "lora_enabled", False))


def lean_normalization_call(unit, input_dtypes, backend: str | None = None) -> bool:
    """Whether the torch back end differentiates an offloaded call of ``unit`` with its lean normalisation
    (keras_lms/offload/torch/lean_norm.py, ``LMSConfig.lean_normalization``): Keras' own BatchNormalization
    with batch statistics (trainable, no renorm, not synchronized), one input, not float64 (Keras on torch
    computes a float64 model's BatchNorm in float32, where the exact recompute is kept). Its backward holds
    the input, its gradient and the output's gradient, no recomputed output and no normalisation temporaries.
    """
    backend = backend or keras.backend.backend()
    return (backend == "torch" and type(unit) is keras.layers.BatchNormalization and unit.trainable
            and not getattr(unit, "renorm", False) and not getattr(unit, "synchronized", False)
            and len(input_dtypes) == 1 and input_dtypes[0] != "float64")


def kernel_copy_bytes(unit) -> int:
    """Keras' torch ``conv`` also copies a 2D/3D kernel to channels-last memory (in the compute dtype), and
    autograd saves that copy with the input's (seen at the level-0 backward of a 3D U-Net: the copies of the
    bottleneck's kernels, kept since the forward pass, 17 MiB of 143)."""
    if not (is_keras_class(unit, {"Conv2D", "Conv3D"}) and runs_keras_kernel_call(unit)):
        return 0
    import numpy as np

    kernel = getattr(unit, "kernel", None)
    if kernel is None:
        return 0
    dtype = str(getattr(unit, "compute_dtype", None) or kernel.dtype).replace("bfloat16", "float16")
    return int(np.prod(kernel.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def saved_extra_bytes(unit, input_bytes: int, output_bytes: int, backend: str | None = None) -> int:
    """Bytes the framework saves for the call's backward besides its inputs and outputs.

    On torch, Keras' channels-last convolutions save a copy of their input (Keras' ``conv`` makes it contiguous
    channels-first, then channels-last again), max pooling a channels-first copy of its input and its indices,
    normalization saves its centred input, and dropout its mask
    (measured with benchmarks/torch_cpu_peak.py). In the plain model they live from the forward call to its
    backward; keras-lms' recompute of an offloaded call re-creates them for its backward. TensorFlow's executed
    graph is calibrated without such extras (its layout optimiser works on whole graphs).
    """
    backend = backend or keras.backend.backend()
    if backend != "torch":
        return 0
    if is_keras_class(unit, CONV_LAYERS | NORMALIZATION_LAYERS | DROPOUT_LAYERS):
        return input_bytes + kernel_copy_bytes(unit)
    if is_keras_class(unit, MAX_POOLING_LAYERS):
        # Keras' torch max_pool copies its input to channels-first (saved), and the int64 indices, one per
        # (float32) output element
        return input_bytes + 2 * output_bytes
    return 0


# Element-wise activations (Keras' own functions): a layer applying one of them is local along every spatial
# axis, so it can be computed in slabs (keras_lms.offload.tf_slabs).
def _elementwise_activation(fn) -> bool:
    acts = keras.activations
    elementwise = {acts.relu, acts.relu6, acts.sigmoid, acts.tanh, acts.elu, acts.selu, acts.linear, acts.gelu,
                   acts.silu, acts.swish, acts.softplus, acts.softsign, acts.hard_sigmoid, acts.hard_silu,
                   acts.leaky_relu, acts.mish, acts.exponential}
    try:
        return fn in elementwise
    except TypeError:  # an unhashable callable
        return False


def slab_halo(unit, rank: int) -> int | None:
    """How many rows of its input on either side one output row reads along the first spatial axis, for a
    layer that can be computed in slabs of that axis (channels-last tensors of ``rank`` >= 3); None for any
    other layer.

    * element-wise activation layers (``ReLU``, ``LeakyReLU``, ``ELU``, ``Activation`` of a Keras element-wise
      function): 0;
    * ``BatchNormalization`` over the last axis, without renorm or synchronisation: 0 (its batch statistics
      are global; the slab machinery computes them over all slabs);
    * ``Conv1D/2D/3D`` running Keras' own ``call`` with ``padding="same"`` (or a 1x1 kernel), stride 1,
      channels last, an odd kernel along the axis and an element-wise activation: ``dilation * (kernel - 1) // 2``.
    """
    from keras_lms import _keras_adapter as adapter

    cls = type(unit)
    if rank < 3:
        return None
    if slab_stride(unit) > 1:
        return 0
    if cls in (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU):
        return 0
    if cls is keras.layers.Activation:
        return 0 if _elementwise_activation(unit.activation) else None
    if cls is keras.layers.BatchNormalization:
        last = isinstance(unit.axis, int) and unit.axis % rank == rank - 1
        return 0 if last and adapter.batchnorm_moments_hook(unit) else None
    if not (is_keras_class(unit, {"Conv1D", "Conv2D", "Conv3D"}) and runs_keras_kernel_call(unit)):
        return None
    pointwise = all(k == 1 for k in unit.kernel_size)  # "valid" and "same" agree for a 1x1 kernel
    if ((unit.padding != "same" and not pointwise) or unit.data_format != "channels_last"
            or any(s != 1 for s in unit.strides) or not _elementwise_activation(unit.activation)
            or unit.kernel_size[0] % 2 == 0):
        return None
    return unit.dilation_rate[0] * (unit.kernel_size[0] - 1) // 2



def slab_stride(unit) -> int:
    """How many input rows make one output row along the first spatial axis: the pool size of a Keras max
    pooling layer whose windows tile that axis (pool size == stride, ``"valid"``, channels last); else 1.

    Such a layer is computed in slabs whose bounds are multiples of the stride (halo 0).
    """
    if not is_keras_class(unit, MAX_POOLING_LAYERS):
        return 1
    pool, strides = unit.pool_size[0], unit.strides[0]
    if unit.padding != "valid" or unit.data_format != "channels_last" or pool != strides or pool < 2:
        return 1
    return pool
