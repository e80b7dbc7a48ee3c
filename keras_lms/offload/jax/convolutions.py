"""Offloaded convolutions that XLA would otherwise compile with full-size temporaries (JAX back end).

In the program XLA compiles for a GPU, a float32 3D convolution runs channels-first: XLA writes a transposed copy
of the input for cuDNN beside the input and the output. At the 16 GiB cube of the 3D U-Net (384^3 float32, 16
filters) the wrapped step's peak is the decoder's first convolution, ``up0_conv1``, which reads a channel
concatenation of the skip and the up-sampled tensor: in the forward the concatenation (6.75 GiB), its transposed
copy (6.75 GiB) and the output (3.38 GiB), and the same again in the backward, where XLA rematerialises the
concatenation (docs/jax_findings.md). Two rewrites of such a call, both the layer's own ``call`` with its
convolution replaced (``_keras_adapter.replaced_convolution``), so bias, activation and autocast stay Keras':

* **over the parts**: a convolution is linear in its input's channels, ``conv([a, b], W) = conv(a, W[..., :ca, :])
  + conv(b, W[..., ca:, :])``, so a convolution that reads a channel concatenation made in the same step convolves
  the parts. Its host residuals are the parts, and the concatenation, left without a reader, is removed by XLA.
  That alone took the backward's peak from 17.36 to 14.01 GiB at 384^3, and left the forward's at 17.36 (both
  parts, a transposed part and the two partial outputs).
* **the forward in windows of rows** (inputs larger than ``LMSConfig.slab_bytes``): the output is computed a
  window of rows of the first spatial axis at a time, each from its input rows widened by the kernel's halo (zero
  rows where the window meets the tensor's edge), written into the output in place
  (``lax.dynamic_update_slice``), each window's input cut only after the previous window's output is written
  (``lax.optimization_barrier``), so only one window's transposes exist at a time. The backward is the unwindowed
  call's (``host_residuals``: the pullback of the original call, its residuals the inputs): a windowed
  backward's transposed slices would be input-sized zero-padded buffers summed at the end.

Both give the plain call's values up to the order of float additions (the per-part sums; each output element is
the same dot product in a window): the partial outputs are float32 (`_wide_convolution`), rounded once to the
compute dtype as the whole convolution's are. Only stride-1 ``"same"`` channels-last convolutions of one group with odd
kernels and a linear activation (the pullback of an activated call would keep its output) are windowed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from keras_lms import _keras_adapter as adapter
from keras_lms.offload.jax import in_place, lean, row_windows

SPLIT_PARTS = True  # False: a convolution reads the concatenation (the control of the compiled-program tests)
WINDOWED = True  # False: every forward runs whole (the control)
CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def _plain_convolution(layer) -> bool:
    """A channels-last convolution of one group (not transposed, depthwise or separable)."""
    return type(layer) in CONVOLUTIONS and layer.data_format == "channels_last" and getattr(layer, "groups", 1) == 1


def windowable(layer) -> bool:
    """Stride 1, "same", odd kernels, a linear activation: each output row reads its input rows +- the halo."""
    return (_plain_convolution(layer) and layer.padding == "same" and all(s == 1 for s in layer.strides)
            and all(k % 2 == 1 for k in layer.kernel_size)
            and layer.activation in (keras.activations.linear, None))


class ConcatenatedInputs:
    """The channel concatenations of one traced step (by output identity: Keras hands a concatenation's output
    object to its reader unchanged where no cast is needed), for the convolutions that read them."""

    def __init__(self):
        self._made = {}  # id(output) -> (output, parts)

    def note(self, layer, args, outputs) -> None:
        """After a call: remember a channel concatenation's output and its parts."""
        if (SPLIT_PARTS and isinstance(layer, keras.layers.Concatenate) and layer.axis == -1 and len(args) == 1
                and isinstance(args[0], (list, tuple))):
            self._made[id(outputs)] = (outputs, list(args[0]))

    def parts_of(self, layer, args, kwargs):
        """The parts a convolution call convolves instead of its input, or None."""
        if not (SPLIT_PARTS and _plain_convolution(layer)) or len(args) != 1 or kwargs:
            return None
        made = self._made.get(id(args[0]))
        if made is None or made[0] is not args[0]:
            return None
        x, parts = args[0], made[1]
        if len(parts) < 2 or any(p.dtype != x.dtype or tuple(p.shape[:-1]) != tuple(x.shape[:-1]) for p in parts):
            return None
        return parts


def halos(layer) -> list:
    """The rows a "same" convolution's output row reads on each side, per spatial axis (its windows widen by
    these, zero beyond the tensor's edges)."""
    return [d * (k - 1) // 2 for k, d in zip(layer.kernel_size, layer.dilation_rate)]


def window_count(layer, inputs, slab_bytes: int) -> int:
    """How many windows of rows the call's forward runs in: its inputs' bytes over ``slab_bytes`` (1: whole)."""
    if not (WINDOWED and slab_bytes and windowable(layer)) or len(inputs[0].shape) < 3:
        return 1
    return row_windows.window_count(sum(row_windows.nbytes(x) for x in inputs), inputs[0].shape[1], slab_bytes)


def transposed_window_count(layer, inputs, slab_bytes: int) -> int:
    """How many windows of rows a block transposed convolution's forward runs in (kernel == strides: input row
    ``i`` makes output rows ``k*i .. k*i+k-1`` alone): its input and output bytes over ``slab_bytes``."""
    if not (WINDOWED and slab_bytes and len(inputs) == 1 and lean.block_conv_transpose(layer)):
        return 1
    return lean.block_transpose_windows(layer, inputs[0], slab_bytes)


def block_transpose_call(layer, original, windows: int):
    """``original`` (a block transposed convolution's own call) a window of input rows at a time, each window's
    output rows written in place into one output buffer. XLA computes the whole call as a cuDNN
    backward-input convolution and adds the bias into a second output-sized buffer: two 4.81 GiB buffers beside
    the skip at the 3D U-Net's 432^3 float32 cube (docs/jax_findings.md)."""
    def call(x):
        shape = tuple(layer.compute_output_shape(x.shape))
        _, out = row_windows.over_rows(lambda rows: ((), original(rows)), [x], [1], x.shape[1], windows,
                                       out=(shape, x.dtype, layer.strides[0]))
        return out

    return call


def convolution_call(layer, original, count: int, windows: int = 1):
    """``original`` (the layer's own call) as a function of the ``count`` tensors its input concatenates (1: the
    input itself), its convolution summed over them and computed in ``windows`` windows of rows."""
    def call(*inputs):
        if len(inputs) != count:
            raise RuntimeError(f"keras-lms: {layer.name!r} was given {len(inputs)} inputs of {count}")  # a bug
        with adapter.replaced_convolution(layer, lambda kernel, op: _convolve(layer, op, inputs, kernel, windows)):
            return original(inputs[0])  # (its input is not read: ``inputs`` are)

    return call


def _kernel_slices(inputs, kernel):
    start, slices = 0, []
    for x in inputs:
        slices.append(kernel[..., start:start + x.shape[-1], :])
        start += x.shape[-1]
    return slices


def _convolve(layer, convolution_op, inputs, kernel, windows: int):
    kernels = _kernel_slices(inputs, kernel)
    if windows <= 1:
        if any(row_windows.on_host(x) for x in inputs):
            raise RuntimeError(f"keras-lms: {layer.name!r} reads a parked part in one window")  # a bug
        if len(inputs) == 1:
            return convolution_op(inputs[0], kernel)
        # one rounding, as the convolution of the concatenation rounds: the partial sums in float32
        return _sum(_wide_convolution(layer, x, k, layer.padding) for x, k in zip(inputs, kernels)).astype(
            inputs[0].dtype)
    widths = halos(layer)
    bounds = row_windows.bounds(inputs[0].shape[1], windows)
    # The output buffer is made only once every input exists as the windows read it (XLA would otherwise
    # allocate it first, beside an input and that input's copy in another layout).
    # (Keras casts the input and the kernel to the compute dtype: the output's too)
    inputs, zero = jax.lax.optimization_barrier((tuple(inputs), jnp.zeros((), inputs[0].dtype)))
    shape = (*inputs[0].shape[:-1], kernel.shape[-1])
    halo = widths[0]
    # written over an input where it can be (`_over_input`): the rows the next window reads of it below its start
    # are then copied (``carry``) before this window's rows are written
    target = _over_input(inputs, shape)
    over = target is not None and all(b - a >= halo for a, b in bounds)
    out = inputs[target] if over else jnp.broadcast_to(zero, shape)
    if over:  # (read from ``out`` from here: the input itself must not stay live beside it)
        inputs = tuple(None if j == target else x for j, x in enumerate(inputs))
    carry = None
    padding = [(0, 0), (0, 0)] + [(h, h) for h in widths[1:]] + [(0, 0)]
    for i, (a, b) in enumerate(bounds):  # (b - a rows, widened by the halo: zero rows beyond the edges)
        if i:  # this window's input is cut once the previous window's output is written
            inputs, out, carry = jax.lax.optimization_barrier((inputs, out, carry))
        pieces = []
        for x, k in zip(inputs, kernels):  # (a part parked on host: only the window's rows come back)
            if x is None and carry is not None:
                rows = jnp.concatenate([carry, row_windows.device_rows(out, a + halo, b, halo, 1)], axis=1)
            else:
                rows = row_windows.device_rows(out if x is None else x, a, b, halo, 1)
            pieces.append(_wide_convolution(layer, jnp.pad(rows, padding), k, "valid"))
        piece = _sum(pieces).astype(out.dtype)
        if over and halo:
            carry = jax.lax.slice_in_dim(out, b - halo, b, axis=1)
            carry, piece = jax.lax.optimization_barrier((carry, piece))
        out = jax.lax.dynamic_update_slice_in_dim(out, piece, a, axis=1)
    return out


def _over_input(inputs, shape) -> int | None:
    """The input the windowed output can be written over (its shape and the output's dtype, on the device: a part
    parked in host memory is read, never written), or None. Its host copy for the backward is made before the
    forward runs (``host_residuals``); a later reader of the input would make XLA copy it first, so values never
    change. At the 3D U-Net's 496^3 float32 cube the decoder's last convolution held its input and its output,
    7.27 GiB each (the step's peak), and at 624^3 mixed_float16 its first held the up-sampled part and its output
    (docs/jax_findings.md)."""
    if not in_place.IN_PLACE:
        return None
    return next((j for j, x in enumerate(inputs) if tuple(x.shape) == tuple(shape) and x.dtype == inputs[0].dtype
                 and not row_windows.on_host(x)), None)


def _wide_convolution(layer, x, kernel, padding):
    """``layer``'s convolution of ``x`` (channels-last, one group) with its output in float32 (float64 for
    float64): a part's or a window's partial output is summed before the one rounding to the compute dtype that
    the convolution of the whole input makes (XLA's float16 and bfloat16 convolutions accumulate in float32).
    Rounded to float16 each, two parts' partial outputs were up to 423 ulp off the correctly rounded sum
    (cancellation), and the 3D U-Net's mixed_float16 gradients 5.6% off the plain model's."""
    kernel = kernel.astype(x.dtype)
    spec = "N" + "DHW"[3 - (x.ndim - 2):] + "C"
    numbers = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, (spec, spec[1:-1] + "IO", spec))
    return jax.lax.conv_general_dilated(x, kernel, tuple(layer.strides), padding.upper(),
                                        rhs_dilation=tuple(layer.dilation_rate), dimension_numbers=numbers,
                                        preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))


def _sum(tensors):
    total = None
    for t in tensors:
        total = t if total is None else total + t
    return total
