"""Slabs: one offloaded layer call computed a slab of its first spatial axis at a time (TensorFlow back end).

Why: with per-layer offload the device peak of a large 3D U-Net is one full-resolution layer's working set,
not the stored activations: BatchNormalization's float32 temporaries (six input-sized float32 buffers under
mixed precision), the layout optimiser's channels-first copies around every float32 convolution and its
gradient, the swapped-in input, and a decoder's concatenation. Computed slab by slab, every one of those is
slab-sized; what remains whole on the device is the call's input (forward) or output gradient (backward) and
the result being assembled.

How, for a call ``y = f(x)`` of a layer that is local along axis 1 (``planning.layer_facts.slab_halo``: output
row i reads input rows i-h..i+h; where it is cut: ``slab_plan``):

* forward (convolutions and BatchNormalization): ``y = concat_s f(x[s0-h : s1+h])``
  cropped to rows [s0, s1). BatchNormalization's batch statistics are computed first, over all slabs (a sum
  of per-slab sums, then of squared differences, as ``tf.nn.moments`` does in one go), and every slab is
  normalised with them through Keras' own ``call``;
* backward: each slab's input window, rows [s0-2h, s1+2h), is cut from the host copy *on the host* and
  brought back alone; the window is recomputed and differentiated with the output gradient restricted to
  rows [s0-h, s1+h) for the input gradient (exact: every output row that reads input rows [s0, s1) is
  correct in the window) and to rows [s0, s1) for the weight gradients (each output row counted once);
  the pieces are concatenated. A plain "same" convolution computes exactly its slab's rows instead, from the
  forward's window [s0-h, s1+h) (``slab_rows``: no halo rows convolved, half the halo rows brought back);
* BatchNormalization's backward takes two passes: the first sums, over slabs, the gradient reaching the batch
  mean and variance; the second differentiates each slab with that total routed through the statistics
  exactly as TensorFlow's own ``reduce_mean`` / ``squared_difference`` gradients do;
* a convolution whose input is a channel concatenation (``StepContext.concat_parts``) takes the concatenated
  tensors as its inputs and concatenates only slab windows, so neither the concatenation nor its gradient is
  ever whole on the device (TensorFlow prunes the unused concatenation). Its forward reads the parts made
  earlier in the forward pass (a U-Net's skip tensor) from their host copies, window by window, once the
  newest part exists: the skip tensor does not wait on the device through the lower levels.

Slabs run one after another: each slab's slicing waits (control dependency) for the previous slab's piece, and
its host-side cut for the piece of the slab before that, so at most two windows are on the device. Input gradients
equal the plain model's up to the order of additions in overlapping sums; weight gradients and batch
statistics are sums over slabs (docs/design.md, "Slabs").
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import tensorflow as tf

from keras_lms.offload.tensorflow.slab_plan import AXIS, SlabPlan, computes_in_slabs_forward, plan_slabs, slab_bounds

__all__ = ["AXIS", "SLAB_SWAP_IN", "SlabPlan", "backward", "computes_in_slabs_forward", "forward", "global_moments",
           "pad_rows", "plan_slabs", "rows", "slab_bounds", "SlabGradients"]

SLAB_SWAP_IN = "lms_swap_in"  # prefix shared with whole-tensor swap-ins (executed-graph tests count them)
LAYOUT_FENCE = "lms_layout_fence"

_fences = weakref.WeakKeyDictionary()  # graph -> {tensor ref: its fence}


def layout_fence(x):
    """``x`` through one ``EnsureShape`` (no copy: the kernel forwards its input), made once per tensor.

    Why: on a GPU, grappler's layout optimiser runs 3D convolutions channels-first and keeps the ops around them
    in that layout where it can. Slices and concatenations are layout-agnostic, so a whole tensor that slab
    windows are cut from, or that slab pieces are assembled into, stays channels-first, and the optimiser puts a
    full-size channels-last copy (a ``Transpose``) on *every* consumer edge that needs channels-last, one per
    window. A later pass merges those copies, but the memory optimizer estimates the graph before that: at
    384^3 it saw 145 GiB for a step that needs 14, and swapped by itself (issue 28). ``EnsureShape`` is not
    layout-agnostic, so the optimiser stops at it: a fenced whole tensor gets one transpose at most, and slab
    pieces fenced before their concatenation keep the assembled tensor channels-last, with window-sized
    transposes only. (Not the gradient pieces of a part whose producer runs whole: ``backward``'s ``fenced``,
    ``SlabCalls._fenced_gradients``.)
    """
    if tf.executing_eagerly() or not isinstance(x, tf.Tensor) or x.shape.rank is None:
        return x
    memo = _fences.setdefault(x.graph, {})
    fenced = memo.get(x.ref())
    if fenced is None:
        with tf.control_dependencies(None), tf.device(x.device or None):
            fenced = tf.ensure_shape(x, x.shape, name=LAYOUT_FENCE)
        memo[x.ref()] = fenced
        memo[fenced.ref()] = fenced  # fencing a fence is the fence itself
    return fenced


def rows(x, a, b):
    """Rows [a, b) of ``x`` along AXIS (a StridedSlice: a new, slab-sized buffer).

    Inside ``gated(...)`` the gate must sit on the StridedSlice itself. ``x[:, a:b]`` would create the slice's
    bound constants inside the control-dependency block too, and TensorFlow then puts the control input on
    those constants only (an op whose inputs were made inside the block counts as already gated). Grappler
    merges equal constants and drops their control inputs, so in the executed graph every slice was ungated:
    a BatchNormalization's upstream-gradient windows were all cut (and cast to float32 under mixed precision)
    as soon as the gradient existed, not one slab ahead. The bounds are therefore made outside any block.
    """
    x = layout_fence(x)
    rank = len(x.shape)
    with tf.control_dependencies(None):
        begin = tf.constant([0, a] + [0] * (rank - 2), tf.int32)
        end = tf.constant([0, b] + [0] * (rank - 2), tf.int32)
        strides = tf.constant([1] * rank, tf.int32)
    every_row_but_axis = ((1 << rank) - 1) & ~(1 << AXIS)
    return tf.strided_slice(x, begin, end, strides, begin_mask=every_row_but_axis, end_mask=every_row_but_axis)


def pad_rows(x, before, after):
    """``x`` with ``before``/``after`` zero rows along AXIS."""
    if not before and not after:
        return x
    paddings = [[0, 0]] * len(x.shape)
    paddings[AXIS] = [before, after]
    return tf.pad(x, paddings)


def halo_padded(x, plan: SlabPlan, s0: int, s1: int, a: int, b: int):
    """Window ``x`` (rows [a, b), clamped to the tensor) with zero rows where [s0 - h, s1 + h) leaves the tensor:
    exactly the ``s1 - s0 + 2h`` rows an exact-rows convolution (``slab_rows``) computes rows [s0, s1) from."""
    return pad_rows(x, a - (s0 - plan.halo), s1 + plan.halo - b)


def rows_of_pieces(pieces, bounds, a, b):
    """Rows [a, b) of a tensor held as pieces (``pieces[k]`` its rows ``bounds[k]``), cut from the pieces they fall
    in and concatenated where they span two. Why: the tensor is never whole, and each piece is freed once the last
    window that reads it is cut (a level sweep's gradients and held outputs, ``sweep_calls``)."""
    cuts = [rows(piece, max(a, s0) - s0, min(b, s1) - s0)
            for piece, (s0, s1) in zip(pieces, bounds) if s0 < b and a < s1]
    return cuts[0] if len(cuts) == 1 else tf.concat(cuts, AXIS)


def gradient_token(pieces):
    """A one-element stand-in for a gradient handed on in ``pieces`` (its reader's backward cuts them with
    ``rows_of_pieces``): the value TensorFlow passes along the gradient edge, so that the reader's backward runs
    (the tape skips an op with no gradient) and its arrival marker fires when the last piece exists, while the
    gradient itself is never concatenated whole. An element of the last piece, not a constant: grappler folds
    constants and drops their control inputs."""
    last = pieces[-1]
    rank = len(last.shape)
    with tf.control_dependencies(None):
        begin = tf.constant([0] * rank, tf.int32)
        end = tf.constant([1] * rank, tf.int32)
    return tf.reshape(tf.strided_slice(last, begin, end), [])


def gated(deps):
    """``tf.control_dependencies`` on the tensors in ``deps`` (nested lists allowed) that exist."""
    return tf.control_dependencies([d for d in tf.nest.flatten(deps) if d is not None])


PARTS_CONCAT = "lms_parts_concat"  # named PARTS_CONCAT_<assembly>_part<k>: the executed-graph test reads them
PARTS_ASSEMBLED = "lms_parts_assembled"
ASSEMBLE_IN_TURN = True  # off: every part concatenated when the scheduler likes (the control of the test)
_assemblies = itertools.count()


def assembled_in_turn(pieces):
    """Per input, its gradient pieces concatenated (None where it has none): one input after the other, and none
    handed on before the last is assembled.

    Why: the gradient of a concatenation's parts (a U-Net decoder's up-sampled tensor and its skip tensor) is
    assembled from window pieces. Left to the scheduler, the skip part's concatenation ran after the up-sampler's
    backward had started (its output gradient was ready first), so that backward's channels-first copies met
    both assembled parts and the skip part's pieces: 21.3 GiB in the executed graph of the 384^3 float32 3D U-Net
    planned for 20 GiB, where the memory model's one-part-at-a-time assembly said 17.1. In turn, at most one
    input's pieces and its concatenation are live beside the inputs already assembled, and the next backward
    starts after the last concatenation (each input passes an ``Identity`` gated on it: no copy; not an
    ``EnsureShape``, which is a layout fence: see ``SlabCalls._fenced_gradients``).
    The concatenation axis is made outside the gates (see ``rows``: an op whose inputs were made inside a
    ``control_dependencies`` block is not gated itself)."""
    if tf.executing_eagerly() or sum(1 for p in pieces if p) < 2:
        return [tf.concat(p, AXIS) if p else None for p in pieces]
    assembly = next(_assemblies)
    names = [f"{PARTS_CONCAT}_{assembly}_part{k}" for k in range(len(pieces))]
    if not ASSEMBLE_IN_TURN:
        return [tf.concat(p, AXIS, name=name) if p else None for p, name in zip(pieces, names)]
    with tf.control_dependencies(None):
        axis = tf.constant(AXIS, tf.int32)
    assembled, previous = [], None
    for p, name in zip(pieces, names):
        if not p:
            assembled.append(None)
            continue
        with gated([previous]):
            previous = tf.concat(p, axis, name=name)
        assembled.append(previous)
    with gated([previous]):
        return [x if x is None or x is previous else tf.identity(x, name=PARTS_ASSEMBLED)
                for x in assembled]


# ------------------------------------------------------------------------------------------------ forward
def global_moments(x, plan: SlabPlan, axes, compute_dtype):
    """Batch mean and (biased) variance of ``x`` over ``axes``, slab by slab: ``tf.nn.moments`` in two passes.

    Returns (mean, variance) of shape [channels], in ``compute_dtype`` (float32 for float16 inputs, as Keras'
    BatchNormalization casts before its moments), and the number of values per channel (a tensor: the batch
    axis may be unknown when the step is traced).
    """
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), list(axes))), compute_dtype)
    sums, prev = [], None
    for s0, s1 in plan.bounds:
        with gated([prev]):
            part = tf.reduce_sum(tf.cast(rows(x, s0, s1), compute_dtype), axes)
        sums.append(part)
        prev = part
    mean = tf.add_n(sums) / count
    squares = []
    for s0, s1 in plan.bounds:
        with gated([prev]):
            part = tf.reduce_sum(tf.math.squared_difference(tf.cast(rows(x, s0, s1), compute_dtype), mean), axes)
        squares.append(part)
        prev = part
    return mean, tf.add_n(squares) / count, count


def forward(run, window_of, n_inputs: int, plan: SlabPlan):
    """``run(windows) -> (output, new_state, losses)`` over every slab; returns the cropped, concatenated
    output and the first slab's new state and losses (all slabs compute the same state from the same batch
    statistics). ``window_of(i, a, b, gate)`` gives input ``i``'s rows [a, b), cut after ``gate`` (the
    previous slab's piece)."""
    pieces, first, prev = [], None, None
    for s0, s1 in plan.bounds:
        a, b = plan.forward_window(s0, s1)
        windows = [window_of(i, a, b, prev) for i in range(n_inputs)]
        if plan.exact_rows:  # run() convolves "valid": its output is rows [s0, s1) (slab_rows)
            output, new_state, losses = run([halo_padded(w, plan, s0, s1, a, b) for w in windows])
            piece = output
        else:
            output, new_state, losses = run(windows)
            piece = rows(output, s0 - a, s1 - a) if (a, b) != (s0, s1) else output
        pieces.append(layout_fence(piece))
        prev = piece
        if first is None:
            first = (new_state, losses)
    return tf.concat(pieces, AXIS), first[0], first[1]


# ----------------------------------------------------------------------------------------------- backward
@dataclasses.dataclass
class SlabGradients:
    """What the slab backward of one call returns: the input gradients, whole, and the summed gradients of
    the trainable values (and of foreign variables, when the layer reads some)."""

    inputs: list
    trainable: list
    foreign: list


def backward(plan: SlabPlan, dy, window_of, differentiate, n_inputs: int, n_weights: int, on_piece=None,
             fenced=None):
    """Differentiate a call slab by slab (see the module docstring).

    ``window_of(i, a, b, gate)`` returns input ``i``'s rows [a, b) on the device, cut after ``gate`` (a
    result of the slab before the previous one, or None); ``differentiate(windows, dy_inputs, dy_weights)``
    recomputes the call on the windows and returns (input gradients of the windows, weight gradients) for the
    two upstream gradients (the same tensor when the layer has no halo). ``on_piece(s0, s1, a, b, pieces)``,
    when given, runs after each slab with its exact input-gradient pieces (rows [s0, s1)) and returns tensors
    the next slabs wait for (a fused chain's further gradients: slab_chains). For an ``exact_rows`` plan
    (slab_rows) the windows come zero-padded to ``s1 - s0 + 2h`` rows, ``dy_inputs`` is dy's rows of the window
    and ``dy_weights`` dy's rows [s0, s1). ``fenced[i]`` (default: every input) says whether input ``i``'s
    gradient pieces pass ``layout_fence`` before their concatenation.
    """
    pieces = [[] for _ in range(n_inputs)]
    weight_parts = [[] for _ in range(n_weights)]
    finished = [None, None]  # a result of the slab before the previous one, and of the previous one
    for s0, s1 in plan.bounds:
        a, b = plan.backward_window(s0, s1)
        # The window is cut once the slab before the previous one has finished: with the previous slab's
        # window it makes two in flight (the copy overlaps the previous slab's compute, and no more).
        windows = [window_of(i, a, b, finished[0]) for i in range(n_inputs)]
        prev_piece = finished[1]
        with gated([prev_piece]):
            # output rows, in the output's own rows (a tiling pooling has halo 0 and output rows = rows/stride)
            g0, g1, oa, ob, o0, o1 = (v // plan.stride for v in (*plan.gradient_rows(s0, s1), a, b, s0, s1))
            if plan.exact_rows:
                # slab_rows: windows padded to full width for the "valid" call, whose output rows [s0, s1) the
                # weight gradients read; the input gradient is the transposed convolution of dy's rows [a, b)
                windows = [halo_padded(w, plan, s0, s1, a, b) for w in windows]
                dy_inputs = rows(dy, g0, g1)
                dy_weights = rows(dy, s0, s1)
            else:
                dy_inputs = pad_rows(rows(dy, g0, g1), g0 - oa, ob - g1)
                dy_weights = dy_inputs if (g0, g1) == (o0, o1) else pad_rows(rows(dy, o0, o1), o0 - oa, ob - o1)
        input_grads, weight_grads = differentiate(windows, dy_inputs, dy_weights)
        done = []
        for i, g in enumerate(input_grads):
            if g is not None:
                piece = rows(g, s0 - a, s1 - a) if (a, b) != (s0, s1) else g
                pieces[i].append(layout_fence(piece) if fenced is None or fenced[i] else piece)
                done.append(pieces[i][-1])
        for j, g in enumerate(weight_grads):
            if g is not None:
                weight_parts[j].append(g)
                done.append(g)
        if on_piece is not None:
            done = list(on_piece(s0, s1, a, b, [p[-1] if p else None for p in pieces])) + done
        # Every result of the slab gates the next ones, not only the first: a BatchNormalization's first pass
        # returns d_mean, which reads only the upstream gradient, and gated on it alone every slab's upstream
        # window was cut (and cast to float32 under mixed precision) at once, each held until its d_variance
        # read the recomputed input window (+5.7 GiB at 448^3 mixed_float16).
        finished = [finished[1], done if done else finished[1]]
    inputs = assembled_in_turn(pieces)
    weights = [tf.add_n(p) if p else None for p in weight_parts]
    return inputs, weights
