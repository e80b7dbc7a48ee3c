"""Tensors parked in host memory between a near reader and a far one (JAX back end).

A U-Net's skip tensor is read twice: by the encoder's next layer and, much later, by the decoder's first
convolution (through a channel concatenation). In the program XLA compiles for a GPU it stays on the device in
between; at the 3D U-Net's 448^3 float32 cube it is one of three 5.36 GiB buffers at the forward's peak, beside the
up-sampled tensor and that convolution's output (docs/jax_findings.md). The plan marks such tensors
(``PlanEntry.parked_inputs``, ``JaxFacts.parked_inputs``): right after the first reader, the step copies the
tensor to host, ordered before that reader's output is used (``lax.optimization_barrier``); the decoder's
convolution then reads its rows from host a window at a time (``row_windows.device_rows``), and its backward
assembles the tensor's gradient in host memory the same way, so neither the tensor nor its gradient waits on
the device between the encoder and the decoder. In the encoder's backward that gradient comes back a window of
rows at a time, each added in place into the near reader's gradient (`parked`).
"""

from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import SymbolicZero

from keras_lms.offload.jax import row_windows

__all__ = ["PARKED", "ParkedTensors", "parked"]

PARKED = True  # False: skips stay on the device (the control of the compiled-program tests)


def parked(x, windows: int):
    """``(x, a copy of x in host memory)``: the near readers read the first, the far reader the second. The
    gradient of ``x`` is the near readers' plus the far reader's (assembled in host memory), added a window of
    rows at a time in place of the near readers' (the far reader's never whole on the device)."""
    return _parked(windows, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _parked(windows, x):
    return x, row_windows.host_copy(x, windows)  # (a window of rows at a time: no transposed full-size copy)


def _parked_forward(windows, x):
    return _parked(windows, x.value), None


def _parked_backward(windows, _, cotangents):
    near, far = cotangents
    if isinstance(far, SymbolicZero):  # the far reader read the tensor from the device after all
        return (near,)
    if isinstance(near, SymbolicZero):
        return (jax.device_put(far, jax.memory.Space.Device),)
    # the far reader's gradient comes back a window of rows at a time, added in place of the near readers'
    _, near = row_windows.over_rows(lambda n, f: ((), n + f), [near, far], [1, 1], near.shape[1], windows,
                                    out=(near.shape, near.dtype, 1), overwrite=[0])
    return (near,)


# (symbolic zeros: an unread host copy's zero cotangent would otherwise be made on the device, which JAX refuses
# as a host value's cotangent)
_parked.defvjp(_parked_forward, _parked_backward, symbolic_zeros=True)


class ParkedTensors:
    """The host copies of one traced step's parked tensors (by identity, as ``convolutions.ConcatenatedInputs``)."""

    def __init__(self):
        self._copies = {}  # id(tensor) -> (tensor, host copy)

    def park(self, tensor, windows: int):
        """``tensor``'s stand-in for its near reader; its host copy is kept for `host_copy`."""
        near, copy = parked(tensor, max(1, windows))
        self._copies[id(tensor)] = (tensor, copy)
        return near

    def order(self, tensor, outputs):
        """``outputs`` (the near reader's) once ``tensor``'s copy to host is done: the copy cannot be late."""
        found = self._copies.get(id(tensor))
        if found is None:
            return outputs
        # (the barrier only orders: the host copy's gradient flows through `parked` alone, so that an unread copy's
        # zero cotangent is never made on the device)
        _, outputs = jax.lax.optimization_barrier((jax.lax.stop_gradient(found[1]), outputs))
        return outputs

    def host_copy(self, tensor):
        """The parked host copy of ``tensor``, or ``tensor`` itself when it was not parked."""
        found = self._copies.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else tensor
