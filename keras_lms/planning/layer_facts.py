"""What is true of Keras' own layers whatever the back end: their classes, activations and locality.

Every fact here is about Keras' own layer classes (a subclass may override ``call`` and is then treated as an
arbitrary layer):

* structural layers (Add, Concatenate, reshapes, padding, cropping, global average pooling) need no tensor
  values for their gradient;
* max pooling reads its input and its output;
* normalization gradients hold a few input-sized temporaries (measured on TensorFlow's executed graph, and the
  torch live-storage peaks agree);
* which layers are local along the first spatial axis, so that they can be computed in slabs (``slab_halo``).

How a framework differentiates them (which activations it differentiates from their output, what it saves
besides) is a fact of the back end: ``keras_lms.planning.backend_facts.BackendFacts``, subclassed by each
back end's offload package.
"""

from __future__ import annotations

import functools

import keras

STRUCTURAL_LAYERS = frozenset({
    "Add", "Subtract", "Concatenate", "Average", "Flatten", "Reshape", "Permute", "RepeatVector", "Identity",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
})
# Average pooling's gradient needs only the input's shape on some back ends (TensorFlow's AvgPool gradient), the
# input itself on others (torch's avg_pool*_backward): BackendFacts.shape_only_layers says which.
AVERAGE_POOLING_LAYERS = frozenset({"AveragePooling1D", "AveragePooling2D", "AveragePooling3D"})
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


def activation_name(fn) -> str:
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


def standalone_activation(unit) -> str | None:
    """The activation a standalone activation layer applies: ``"relu"`` for ``ReLU()`` without options, the
    Keras name for ``Activation(fn)`` of one of Keras' relu-like/linear functions, else None."""
    if type(unit) is keras.layers.Activation:
        return activation_name(unit.activation) or None
    return "relu" if is_plain_relu(unit) else None


def fused_activation(unit) -> str | None:
    """The Keras name of the relu-like/linear activation a Dense/Conv-family layer applies at the end of Keras'
    own ``call``, or None (another activation, or a subclass that overrides ``call``)."""
    if not runs_keras_kernel_call(unit):
        return None
    return activation_name(getattr(unit, "activation", None)) or None


@functools.lru_cache(maxsize=1)  # (asked for every call each time the planner predicts a step)
def _kernel_classes() -> tuple:
    """The Dense/Conv-family classes and the set of their own ``call`` methods."""
    classes = tuple(getattr(keras.layers, name) for name in sorted(KERNEL_LAYERS) if hasattr(keras.layers, name))
    return classes, frozenset(cls.call for cls in classes)


def runs_keras_kernel_call(unit) -> bool:
    """An instance of a Dense/Conv-family class (or a subclass) whose ``call`` is Keras' own."""
    classes, calls = _kernel_classes()
    return isinstance(unit, classes) and type(unit).call in calls


def is_linear_activation(unit) -> bool:
    return type(unit) is keras.layers.Activation and activation_name(unit.activation) == "linear"


# Element-wise activations (Keras' own functions): a layer applying one of them is local along every spatial
# axis, so it can be computed in slabs (keras_lms.offload.tensorflow.slabs).
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



UPSAMPLING_LAYERS = frozenset({"Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "UpSampling1D",
                               "UpSampling2D", "UpSampling3D"})


def upsampling_scale(unit, rank: int) -> int | None:
    """Output rows per input row along the first spatial axis for a layer whose output rows ``[a, b)`` are
    exactly the layer run on input rows ``[a // s, ceil(b / s))``, cropped: a Keras transposed convolution whose
    kernel equals its stride along that axis (the kernel's copies tile the output, no overlap), ``"same"`` or
    ``"valid"`` (equal then), no output padding, dilation 1, channels last, an element-wise activation; a Keras
    nearest-neighbour ``UpSampling1D/2D/3D``. None for any other layer.

    Why: a U-Net's up-sampled tensor is 4x (2D: 2x) the bytes of its input; recomputed from that input's host
    copy, which its own backward reads anyway, it need not be copied at all (``planning.recompute``).
    """
    if rank < 3 or not is_keras_class(unit, UPSAMPLING_LAYERS):
        return None
    if getattr(unit, "data_format", "channels_last") != "channels_last":
        return None
    name = type(unit).__name__
    if name.startswith("UpSampling"):
        if getattr(unit, "interpolation", "nearest") != "nearest":
            return None
        size = unit.size if isinstance(unit.size, (tuple, list)) else (unit.size,)
        return int(size[0]) if int(size[0]) >= 2 else None
    if not runs_keras_kernel_call(unit) or not _elementwise_activation(unit.activation):
        return None
    kernel, stride = unit.kernel_size[0], unit.strides[0]
    if (kernel != stride or stride < 2 or getattr(unit, "output_padding", None) is not None
            or any(d != 1 for d in unit.dilation_rate) or unit.padding not in ("same", "valid")):
        return None
    return stride


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
