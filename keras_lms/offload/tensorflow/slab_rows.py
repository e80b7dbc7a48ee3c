"""Exact-row convolution slabs: a slab of a "same" convolution computed as exactly its own rows.

Why: a slab of rows ``[s0, s1)`` of a convolution with halo ``h`` needs input rows ``[s0 - h, s1 + h)``. Run
"same" on that window, the convolution also computes the ``2h`` rows at its edges, which are cropped; its
backward differentiated the same call on a window twice as wide (``[s0 - 2h, s1 + 2h)``, so that every output
row reading the slab's rows is in it) and convolved ``4h`` extra rows for each gradient. With 14-row slabs of
a 3x3x3 convolution that was 23% more convolution FLOPs in the step, and 29% more rows of every input brought
back from the host where 14% suffice. Now the forward and the weight gradient convolve no extra row and the
input gradient ``2h``.

How (``SlabPlan.exact_rows``, chosen by ``slab_plan.computes_exact_rows``):

* the window is zero-padded to exactly ``s1 - s0 + 2h`` rows where it meets the tensor's edge (what "same"
  pads there) and by the kernel's half width along every other spatial axis, and the layer's own ``call`` runs
  on it with ``padding="valid"``: its output is rows ``[s0, s1)``, nothing cropped (``slabs.halo_padded``,
  ``padded`` and ``adapter.valid_convolution``);
* the weight gradients differentiate that call with the output gradient's rows ``[s0, s1)``: each output row
  once, as in the whole call;
* the input gradient is the transposed convolution of the output gradient's rows ``[s0 - h, s1 + h)``, cropped
  to ``[s0, s1)`` (``input_gradient``): it needs no input rows, so the backward's window is the forward's,
  ``[s0 - h, s1 + h)``, read for the weight gradient only. It convolves the ``2h`` rows it crops (a flipped-
  kernel "valid" convolution would not, but its flipped kernel, one tensor shared by all slabs, was swapped by
  grappler's memory optimizer on a 16 GiB GPU: 22-24 tiny swaps per step, where the kernel itself is never a
  candidate).

The values are the whole call's: the same products, summed in another order (float64 agrees to 1e-12,
``tests/offload/tensorflow/test_slabs.py``). ``tests/offload/tensorflow/test_link_traffic.py`` counts the
convolution FLOPs and the bytes brought back in the executed graph beside the control that convolves every
window whole (``slab_plan.EXACT_ROWS = False``).
"""

from __future__ import annotations

import tensorflow as tf

from keras_lms.offload.tensorflow.slab_plan import AXIS


def _half_widths(unit) -> list:
    return [(k - 1) // 2 for k in unit.kernel_size]


def padded(x, unit, before: int, after: int):
    """``x`` with ``before``/``after`` zero rows along AXIS and the kernel's half width of zeros on both sides
    of every other spatial axis: the padding "same" would add, made explicit for a "valid" call."""
    halves = _half_widths(unit)
    paddings = [[0, 0]] + [[h, h] for h in halves] + [[0, 0]]
    paddings[AXIS] = [before, after]
    if not any(p for pair in paddings for p in pair):
        return x
    if not tf.executing_eagerly() and isinstance(x, tf.Tensor) and x.op.type in ("Pad", "PadV2"):
        # A window at the tensor's edge arrives padded along AXIS. TensorFlow 2.21's CPU remapper fuses
        # Pad -> Pad -> Conv3D into one convolution with the *first* Pad's paddings only (the output came out
        # two columns short); an EnsureShape between the pads (no copy) keeps the fusion to the adjacent Pad.
        x = tf.ensure_shape(x, x.shape, name="lms_pad_fence")
    return tf.pad(x, paddings)


def input_gradient(unit, dy):
    """The input gradient of rows ``[s0 - h, s1 + h)`` from ``dy``, the output gradient's same rows (clamped to
    the tensor): the transposed convolution of a stride-1 "same" convolution, which reads the kernel and no input
    rows. Its rows ``[s0, s1)`` are exact (each reads ``dy`` rows within ``h`` of it); the ``h`` rows at each end
    see zeros beyond the window and are cropped by the caller. Runs inside the layer's stateless scope
    (``adapter.run_stateless``), where ``unit.kernel`` is the forward's value."""
    kernel = tf.cast(tf.convert_to_tensor(unit.kernel), dy.dtype)
    output_shape = tf.concat([tf.shape(dy)[:-1], tf.shape(kernel)[-2:-1]], 0)
    return tf.nn.conv_transpose(dy, kernel, output_shape, strides=1, padding="SAME")
