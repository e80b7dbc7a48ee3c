"""The JAX step context: decides each intercepted call and runs the offloaded ones with host residuals.

Keras' JAX trainer differentiates ``compute_loss_and_updates`` with ``jax.value_and_grad`` inside ``jax.jit``:
the wrapped model's forward pass is traced once per input signature, and what that trace builds is what XLA
compiles. An offloaded call becomes a ``jax.custom_vjp`` whose forward rule moves the call's large backward
residuals (a convolution's input, a BatchNorm's normalised input...) to host memory, ordered by optimisation
barriers so that XLA's scheduler can neither copy late nor bring back early (`host_residuals`,
``docs/jax_findings.md``); a call the plan keeps on the device runs as Keras runs it.
"""

from __future__ import annotations

import jax
import keras

from keras_lms.offload import common
from keras_lms.offload.jax import convolutions, in_place, parking, row_windows
from keras_lms.offload.jax.convolution_backward import windowed_pullback
from keras_lms.offload.jax.convolutions import ConcatenatedInputs, convolution_call, window_count
from keras_lms.offload.jax.devices import validate_host_device
from keras_lms.offload.jax.host_residuals import host_residual_call
from keras_lms.offload.jax.tracing import TENSOR_FACTS
from keras_lms.planning.plan import tensor_bytes


class StepContext(common.InterceptingContext):
    """State of one traced training forward pass of a wrapped model (JAX)."""

    def __init__(self, config, structure, plan, eager: bool = False):
        super().__init__(config, structure, plan, eager, host=validate_host_device(config.host_device))
        self.concatenations = ConcatenatedInputs()
        self.parked = parking.ParkedTensors()

    @staticmethod
    def tensor_bytes(tensor) -> int:
        return tensor_bytes(tuple(tensor.shape), keras.backend.standardize_dtype(tensor.dtype))

    tensor_rank = staticmethod(TENSOR_FACTS.rank)

    def call(self, index, unit, original, args, kwargs):
        tensors = TENSOR_FACTS.tensors((args, kwargs))
        decision = self._decision(index, unit, tensors)
        entry = self.plan[index] if index < len(self.plan) and self.plan[index].layer == unit.name else None
        parked = [tensors[j] for j in (entry.parked_inputs if entry is not None and parking.PARKED else ())]
        for tensor in parked:  # a far reader reads it from host (``parking``); this call reads its stand-in
            rows = tensor.shape[1] if len(tensor.shape) > 1 else 1
            near = self.parked.park(tensor, row_windows.window_count(row_windows.nbytes(tensor), rows,
                                                                     self.config.slab_bytes))
            args, kwargs = jax.tree.map(lambda t, tensor=tensor, near=near: near if t is tensor else t, (args, kwargs))
        if not decision.offloaded or not isinstance(unit, keras.layers.Layer):
            outputs = original(*args, **kwargs)
        else:
            outputs = self._offloaded_call(unit, original, args, kwargs)
        self.concatenations.note(unit, args, outputs)
        for tensor in parked:
            outputs = self.parked.order(tensor, outputs)
        return outputs

    def _offloaded_call(self, unit, original, args, kwargs):
        own, forward, pullback = original, None, None
        parts = self.concatenations.parts_of(unit, args, kwargs)
        if parts is not None:  # a convolution over a concatenation: its parts, never the concatenation
            original, args = convolution_call(unit, own, len(parts)), tuple(parts)
        windows = window_count(unit, args, self.config.slab_bytes) if not kwargs else 1
        if windows > 1:  # a large convolution's forward and backward in windows of rows
            forward = convolution_call(unit, own, len(args), windows)
            pullback = windowed_pullback(unit, len(args), windows)
            if parts is not None and pullback is not None:  # parts parked on host are read from there (``parking``)
                args = tuple(self.parked.host_copy(p) for p in args)
        elif not kwargs and (blocks := convolutions.transposed_window_count(unit, args, self.config.slab_bytes)) > 1:
            forward = convolutions.block_transpose_call(unit, own, blocks)  # (its lean backward: in windows too)
        elif (rows := in_place.in_place_windows(unit, args, kwargs, self.config.slab_bytes)) > 1:
            forward = in_place.in_place_call(unit, own, rows)  # written over its input (its backward: as before)
        # The plan chose this call for its input bytes; what goes to host is what its backward reads, from the
        # same threshold (the layer's weights always stay).
        return host_residual_call(unit, original, *args, min_bytes=self.config.min_bytes, forward_call=forward,
                                  lean_normalization=self.config.lean_normalization,
                                  slab_bytes=self.config.slab_bytes, pullback_maker=pullback, **kwargs)
