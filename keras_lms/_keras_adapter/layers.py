"""Masks and layer internals: Keras masks on tensors, losses left on layers, BatchNorm and fused activations.

Keras internals relied on (Keras 3.15), and why:

* ``keras.src.backend.common.masking.get_keras_mask`` / ``set_keras_mask``: an offloaded call's outputs are
  recomputed or re-created outside ``Layer.__call__``, which is what attaches masks; the masks are read in the
  forward pass and attached again;
* ``Layer._clear_losses``: a throw-away planning trace leaves the losses its ``add_loss`` calls made on the
  layers; they must go before the real step;
* ``BatchNormalization._moments`` (called by ``BatchNormalization.call`` for the batch statistics): the
  TensorFlow back end hooks it to give the recompute the forward's statistics with their exact gradient;
  ``_reduction_axes`` is *not* read, :func:`batchnorm_reduction_axes` derives the same list from public
  attributes;
* Dense, EinsumDense and the convolution layers store ``activation`` in the instance dict in ``__init__`` and
  read ``self.activation`` at call time: the TensorFlow back end recomputes the pre-activation by shadowing it
  with ``linear`` and restores exactly what :func:`fused_activation` returned;
* the convolution layers store ``padding`` in the instance dict and ``BaseConv.convolution_op`` reads
  ``self.padding`` at call time: the TensorFlow back end runs a slab of a "same" convolution, explicitly padded,
  through the layer's own ``call`` with ``"valid"`` (:func:`valid_convolution`);
* ``BaseConv.call`` convolves through ``self.convolution_op(inputs, self.kernel)`` and then adds the bias and
  applies the activation: the JAX back end convolves a concatenation's parts, or in windows of rows, in its place
  (:func:`replaced_convolution`).
"""

from __future__ import annotations

import contextlib

import keras

from keras_lms._keras_support import SUPPORTED_KERAS, patched_attribute


def get_mask(x):
    """The Keras mask attached to a tensor, or None."""
    from keras.src.backend.common.masking import get_keras_mask

    try:
        return get_keras_mask(x)
    except AttributeError:  # pragma: no cover - tensors that cannot carry attributes
        return None


def set_mask(x, mask) -> None:
    """Attach a Keras mask to a tensor (what ``Layer.__call__`` does for layers that support masking)."""
    from keras.src.backend.common.masking import set_keras_mask

    if mask is not None:
        set_keras_mask(x, mask)


def clear_losses(layer) -> None:
    """Drop losses that ``add_loss`` left on ``layer`` and its sublayers (e.g. from a planning trace)."""
    layer._clear_losses()


def batchnorm_moments_hook(layer):
    """Name of the BatchNormalization method that computes batch statistics, when it can be hooked.

    Keras' BatchNormalization.call gets (mean, variance) from ``self._moments(inputs, mask)``; renorm and
    synchronized BatchNorm do more than that, so they are not hooked.
    """
    if (type(layer).call is keras.layers.BatchNormalization.call and not getattr(layer, "renorm", False)
            and not getattr(layer, "synchronized", False) and hasattr(layer, "_moments")):
        return "_moments"
    return None


def batchnorm_reduction_axes(layer, inputs) -> list[int]:
    """The axes BatchNormalization's ``_moments`` reduces ``inputs`` over: every axis but ``layer.axis``.

    Why: the TensorFlow back end gives the recompute the forward's batch statistics with their exact gradient,
    which needs these axes. Keras 3.15 stores them in ``build`` as the private ``_reduction_axes``
    (``range(ndim)`` without ``axis``); this derives the same list from the public ``axis`` and the input's rank.
    """
    ndim = len(inputs.shape)
    return [i for i in range(ndim) if i != layer.axis % ndim]


def fused_activation(layer):
    """The activation a Dense/Conv-family layer's own ``call`` applies last, as stored on the instance.

    Why: the TensorFlow back end recomputes such a layer's pre-activation by shadowing ``activation`` on the
    instance with ``linear``, then restores what this returns. Keras 3.15's Dense, EinsumDense and convolution
    layers store it as an instance attribute in ``__init__`` and their ``call`` reads ``self.activation`` at call
    time; reading the instance dict (not the attribute) makes the restore exact.
    """
    try:
        return vars(layer)["activation"]
    except (KeyError, TypeError):
        raise RuntimeError(
            f"keras_lms._keras_adapter.fused_activation() expects {type(layer).__name__} to store `activation` on "
            f"the instance, as Keras {SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} does; Keras {keras.__version__} does "
            "not. The adapter needs updating for this Keras."
        ) from None


@contextlib.contextmanager
def valid_convolution(layer):
    """Within the block, a convolution layer's own ``call`` convolves ``"valid"``.

    Why: the TensorFlow back end computes a slab of a ``"same"`` convolution as exactly its rows (``slab_rows``):
    it pads the window itself and runs the layer's call without padding. Keras 3.15's convolution layers store
    ``padding`` on the instance and ``BaseConv.convolution_op`` reads ``self.padding`` at call time; the
    instance value is shadowed for the block and restored exactly.
    """
    if "padding" not in vars(layer):
        raise RuntimeError(
            f"keras_lms._keras_adapter.valid_convolution() expects {type(layer).__name__} to store `padding` on "
            f"the instance, as Keras {SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} does; Keras {keras.__version__} does "
            "not. The adapter needs updating for this Keras."
        )
    with patched_attribute(layer, "padding", "valid"):
        yield


@contextlib.contextmanager
def replaced_convolution(layer, convolve):
    """Within the block, a convolution layer's own ``call`` computes its convolution as ``convolve(kernel,
    convolution_op)`` (the kernel as the call reads it: autocast, from the stateless scope; the layer's own
    ``convolution_op(inputs, kernel)``) and ignores the input it is given; the bias and the activation are still
    the call's own.

    Why: the JAX back end convolves a channel concatenation's parts (each with its channels' slice of the kernel)
    instead of the concatenation, and a large forward in windows of rows (``offload/jax/convolutions.py``).
    Keras 3.15's ``BaseConv.call`` convolves through ``self.convolution_op(inputs, self.kernel)``, read at call
    time; it is shadowed for the block.
    """
    if not callable(getattr(layer, "convolution_op", None)) or getattr(layer, "groups", 1) != 1:
        raise RuntimeError(
            f"keras_lms._keras_adapter.replaced_convolution() expects {type(layer).__name__} to convolve through "
            f"`convolution_op` with one group, as Keras {SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]}'s BaseConv does; "
            f"Keras {keras.__version__} does not. The adapter needs updating for this Keras."
        )
    own = layer.convolution_op
    with patched_attribute(layer, "convolution_op", lambda _inputs, kernel: convolve(kernel, own)):
        yield
