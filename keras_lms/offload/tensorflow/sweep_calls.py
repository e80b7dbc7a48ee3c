"""The TensorFlow step context's level sweeps (``StepContext`` inherits them): the passes that differentiate a run
of ``convolution -> BatchNormalization -> activation`` units over slab windows recomputed from the run's input
(what a sweep is, and why: ``sweeps``)."""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.tensorflow import output_gradients, slabs, sweeps
from keras_lms.offload.tensorflow.devices import on_device
from keras_lms.offload.tensorflow.pooling_fold_calls import pooling_input_gradient, reads_output_alone
from keras_lms.offload.tensorflow.recompute_scopes import TotalMoments
from keras_lms.offload.tensorflow.sweeps import sweep_bounds

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SweepRun:
    """One step's sweep: the records of its units ``[(conv, bn, act), ...]`` and what each pass hands on.

    ``gradients[j]``: BatchNorm j's output gradient (``G_j``) as ``(pieces, their rows)``, one piece per window
    (``sweeps.GRADIENTS_IN_PIECES``; else one whole piece), and ``tokens[j]`` what TensorFlow passes along the
    gradient edges for it (``slabs.gradient_token``; else the whole tensor); ``first_pass[j]``: its first-pass totals
    (``TotalMoments``); ``normalization_weights[j]``: its scale and offset gradients; ``convolution[j]``: the
    convolution's (input gradients, weight gradients). Units are numbered from 1, in forward order.
    ``held``: the units whose convolution output pass A keeps, one piece per window in ``outputs[j]``, for the
    later passes to slice (``sweeps.Sweep.held``). ``folded``: the index of the pooling whose input gradient pass
    A takes (``sweeps.Sweep.folded``), and ``pooling`` its record and output gradient once its backward ran;
    ``align`` its stride.
    """

    units: list
    bounds: tuple
    length: int
    held: frozenset = frozenset()
    outputs: dict = dataclasses.field(default_factory=dict)
    gradients: dict = dataclasses.field(default_factory=dict)
    tokens: dict = dataclasses.field(default_factory=dict)
    first_pass: dict = dataclasses.field(default_factory=dict)
    normalization_weights: dict = dataclasses.field(default_factory=dict)
    convolution: dict = dataclasses.field(default_factory=dict)
    folded: int | None = None
    align: int = 1
    pooling: tuple | None = None

    @property
    def size(self) -> int:
        return len(self.units)


class SweepCalls:
    """Level sweeps of a ``StepContext`` (a mixin next to ``SlabCalls``: it uses the context's ``records``,
    ``_slab_call``, ``_host_window``, ``_chain_input_window``, ``_exact_input_gradients`` and
    ``_fenced_gradients``)."""

    # ------------------------------------------------------------------ forward: bind the run's records
    def _bind_sweep(self, indices, windows: int, held=(), folded=None) -> None:
        """After the run's last call: give its records their roles, or leave them to the per-call backward (with
        a warning) when the step did not build what the passes need. ``folded``: ``(pooling call, stride)``
        (``PlanEntry.sweep_folded``)."""
        records = [self.records.get(i) for i in indices]
        why = _unsweepable(records)
        if why is not None:
            log.warning("keras-lms: the level sweep of calls %s runs call by call instead: %s.", list(indices), why)
            return
        units = [tuple(records[k:k + 3]) for k in range(0, len(records), 3)]
        length = units[0][0].slabs.length
        align = folded[1] if folded is not None else 1
        run = SweepRun(units, sweep_bounds(length, windows, align), length, frozenset(held),
                       folded=folded[0] if folded is not None else None, align=align)
        for j, (conv, bn, act) in enumerate(units, 1):
            conv.sweep, bn.sweep, act.sweep = (run, "conv", j), (run, "bn", j), (run, "act", j)
        if run.folded is not None:
            self.folded_poolings[run.folded] = run

    def _check_folded_pooling(self, index, unit, tensors) -> None:
        """At a folded pooling's forward: it must read the run's output alone, else it differentiates itself
        (with a warning; the plan's memory was predicted for the fold)."""
        run = self.folded_poolings.get(index)
        if run is None:
            return
        act = run.units[-1][2]
        if not reads_output_alone(tensors, act):
            log.warning("keras-lms: %r does not read %r's output as planned; its gradient is taken by its own "
                        "backward, not the level sweep's first pass.", unit.name, act.unit.name)
            del self.folded_poolings[index]
            run.folded = None

    def _fold_into_sweep(self, run, record, dy):
        """A folded pooling's backward: hand its output gradient to the run's pass A, return no input gradient
        (so the activation's gradient is the concatenation's part alone: no whole sum)."""
        run.pooling = (record, dy)
        return [None] * (len(record.hosts) + len(record.trainable))

    # ------------------------------------------------------------------ backward
    def _sweep_backward(self, record, dy, trigger, foreign_variables):
        """The backward of a call in a sweep: the last activation runs pass A, each BatchNorm its pass B; the
        convolutions and inner activations return what those passes handed them."""
        run, role, j = record.sweep
        if foreign_variables is not None:
            raise RuntimeError(f"keras-lms: {record.unit.name!r} reads variables of other layers, which a level "
                               "sweep does not differentiate; set keras_lms.offload.tensorflow.sweeps.ENABLED = "
                               "False")  # the planner never sweeps such a call (a bug if it happens)
        if role == "act":
            if j == run.size:
                with tf.name_scope(f"lms_sweep_{record.unit.name}"):  # names the pass in the executed graph
                    return [self._sweep_first_pass(run, dy, trigger, record)]
            return [run.tokens[j]]
        if role == "bn":
            with tf.name_scope(f"lms_sweep_{record.unit.name}"):
                self._sweep_second_pass(run, j, dy, trigger, record)
            return [dy] + run.normalization_weights[j]  # the input's entry is unread: conv j took dc_j itself
        inputs, weights = run.convolution[j]
        return inputs + weights

    def _sweep_first_pass(self, run, dy, trigger, reader):
        """Pass A: ``G_m`` (the last activation's input gradient) and BatchNorm m's first pass."""
        m = run.size
        _, bn, act = run.units[m - 1]
        direct = output_gradients.input_gradient_from_output(act.unit)
        run.outputs = {j: [] for j in run.held}
        pieces, parts, finished = [], [], [None, None]
        if sweeps.GRADIENTS_IN_PIECES:
            # every window of dy cut at once, so that dy is freed before any piece is made (gated on the pass,
            # not whole beside them all to its end: held outputs, G_m); at the prefetch trigger, not as soon as dy
            # exists: a U-Net skip's gradient exists from the decoder's pass on, and its windows, cut there, met
            # the decoder's peak (16.75 GiB executed at 400^3 float32, where the plan was predicted at 13.0)
            with on_device(reader.compute_device), slabs.gated([trigger]):
                dy_windows = [slabs.rows(dy, s0, s1) for s0, s1 in run.bounds]
        for k, (s0, s1) in enumerate(run.bounds):
            c, r = self._sweep_rows(run, m, s0, s1, finished[0], trigger, reader, window=(s0, s1))
            with on_device(reader.compute_device):
                if sweeps.GRADIENTS_IN_PIECES:
                    dy_rows = dy_windows[k]
                else:
                    with slabs.gated([finished[1]]):
                        dy_rows = slabs.rows(dy, s0, s1)
                if run.folded is not None and run.folded in self.records:  # (else TensorFlow differentiated it)
                    dy_rows = dy_rows + self._folded_pooling_rows(run, r, s0, s1)
                g = direct(r, dy_rows)
                first = self._first_pass_piece(bn, c, g)
            pieces.append(slabs.layout_fence(g))
            parts.append(first)
            finished = [finished[1], [g] + [t for t in first if t is not None]]
        self._hand_on_gradient(run, m, pieces)
        self._hand_first_pass(run, m, parts)
        return run.tokens[m]

    def _folded_pooling_rows(self, run, r, s0, s1):
        """Rows [s0, s1) of the folded pooling's input gradient: the pooling recomputed on pass A's activation rows
        ``r`` and differentiated for its output gradient's rows [s0 / stride, s1 / stride) (it tiles: those rows
        are the window's own)."""
        if run.pooling is None:  # its backward runs before the activation's, which it reads: a bug if not
            raise RuntimeError("keras-lms: the level sweep's first pass ran before the folded pooling's backward; "
                               "set keras_lms.offload.tensorflow.sweeps.FOLD_POOLING = False")
        pooling, dy = run.pooling
        return pooling_input_gradient(self, pooling, r, slabs.rows(dy, s0 // run.align, s1 // run.align))

    @staticmethod
    def _hand_on_gradient(run, j, pieces) -> None:
        """Keep ``G_j`` for pass B_j: its window pieces as they are (``sweeps.GRADIENTS_IN_PIECES``), with a token on
        the gradient edges; else concatenated. Why pieces: pass B_j reads ``G_j`` window by window, and each piece
        is freed once read, while the next gradient's pieces are made; concatenated, ``G_j`` was whole beside its
        pieces at the end of the pass before and whole beside the next gradient's pieces through pass B_j (at
        400^3 float32, 3.8 GiB each: the level-0 decoder could not hold both units, docs/design.md)."""
        if sweeps.GRADIENTS_IN_PIECES:
            run.gradients[j] = (pieces, run.bounds)
            run.tokens[j] = slabs.gradient_token(pieces)
        else:
            whole = tf.concat(pieces, slabs.AXIS)
            run.gradients[j] = ([whole], ((0, run.length),))
            run.tokens[j] = whole

    def _sweep_second_pass(self, run, j, G, trigger, reader):
        """Pass B_j: BatchNorm j's second pass and convolution j's backward on ``c_j``'s recomputed rows, and, for
        j > 1, activation j-1's gradient and BatchNorm j-1's first pass on the same windows."""
        conv, bn, _ = run.units[j - 1]
        plan, length, totals = conv.slabs, run.length, run.first_pass[j]
        weights = list(conv.trainable)
        inner = run.units[j - 2] if j > 1 else None
        direct = output_gradients.input_gradient_from_output(inner[2].unit) if inner else None
        n_inputs = 1 if inner else len(conv.hosts)
        input_pieces = [[] for _ in range(n_inputs)]
        weight_parts, gradient_pieces, first_parts = [], [], []
        fenced = None if inner else self._fenced_gradients(conv)
        finished = [None, None]
        for s0, s1 in run.bounds:
            g0, g1 = max(0, s0 - plan.halo), min(length, s1 + plan.halo)  # rows of dc_j the input gradient reads
            lo, hi = max(0, g0 - plan.halo), min(length, g1 + plan.halo)  # rows of the input that gives them
            gate = finished[0] if finished[0] is not None else totals.gate
            if inner:
                c_prev, r_prev = self._sweep_rows(run, j - 1, lo, hi, gate, trigger, reader)
                xs = [r_prev]
            else:
                xs = self._sweep_input_windows(run, lo, hi, gate, trigger, reader)
            with on_device(reader.compute_device):
                with slabs.gated([finished[1]]):
                    g_rows = slabs.rows_of_pieces(*run.gradients[j], g0, g1)  # (G: the token, unread)
                padded = [slabs.halo_padded(x, plan, g0, g1, lo, hi) for x in xs]
                with tf.GradientTape(watch_accessed_variables=False) as weight_tape:
                    weight_tape.watch(weights)
                    convolved = tf.nest.flatten(self._slab_call(conv, padded, conv.trainable)[0])[0]
                c = convolved
                if j in run.held:  # pass A's rows: the convolution above is read by its weight gradient alone,
                    with slabs.gated([gate]):  # which needs only its input, so TensorFlow prunes it
                        c = _held_rows(run, j, g0, g1)
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(c)
                    y = tf.nest.flatten(self._slab_call(bn, [c], bn.trainable, totals)[0])[0]
                dc = tape.gradient(y, c, output_gradients=g_rows)  # rows [g0, g1) of dc_j
                own = pad_own_rows(dc, s0 - g0, s1 - g0)  # each output row's weight gradient once
                weight_grads = weight_tape.gradient(convolved, weights, output_gradients=own)
                input_grads = [slabs.rows(d, s0 - g0, s1 - g0)
                               for d in self._exact_input_gradients(conv, xs, dc)]
                done = [g for g in weight_grads if g is not None]
                if inner:
                    rows_own = (s0 - lo, s1 - lo)
                    g = direct(slabs.rows(r_prev, *rows_own), input_grads[0])
                    first = self._first_pass_piece(inner[1], slabs.rows(c_prev, *rows_own), g)
                    gradient_pieces.append(slabs.layout_fence(g))
                    first_parts.append(first)
                    done += [g] + [t for t in first if t is not None]
                else:
                    for i, piece in enumerate(input_grads):
                        input_pieces[i].append(slabs.layout_fence(piece) if fenced is None or fenced[i] else piece)
                    done += input_grads
            weight_parts.append(weight_grads)
            finished = [finished[1], done]
        summed = [_sum([p[k] for p in weight_parts]) for k in range(len(weights))]
        if inner:
            self._hand_on_gradient(run, j - 1, gradient_pieces)
            self._hand_first_pass(run, j - 1, first_parts)
            run.convolution[j] = ([run.tokens[j - 1]], summed)  # the input's entry is unread (see above)
        else:
            run.convolution[j] = (slabs.assembled_in_turn(input_pieces), summed)

    # ------------------------------------------------------------------ windows
    def _sweep_input_windows(self, run, a, b, gate, trigger, reader):
        """Rows [a, b) of the run's input(s) (the first convolution's; a concatenation's parts), from their host
        copies (or recomputed windows), sliced where the plan kept them, or through a fused chain."""
        conv = run.units[0][0]
        if conv.chain is not None and conv.chain[1] is not None:
            return [self._chain_input_window(conv, a, b, [trigger, gate], reader, "bwd")[1]]
        windows = []
        for host, kept in zip(conv.hosts, conv.kept):
            if host is not None:
                windows.append(self._host_window(host, a, b, [trigger, gate], reader))
            else:
                with on_device(reader.compute_device), slabs.gated([gate]):
                    windows.append(slabs.rows(kept, a, b))
        return windows

    def _sweep_rows(self, run, j, a, b, gate, trigger, reader, window=None):
        """(``c_j``, ``r_j``) rows [a, b): unit j's forward recomputed, with the forward's statistics and weights,
        from its input's rows widened by the convolution's halo (recursively down to the run's input); a held
        unit's ``c_j`` sliced from pass A's pieces. In pass A (``window``: its rows ``(s0, s1)``) a held unit's
        rows of that window are kept as its piece."""
        conv, bn, act = run.units[j - 1]
        plan = conv.slabs
        mean, variance, _ = bn.moments[0]
        if j in run.held and window is None:
            with on_device(reader.compute_device), slabs.gated([gate]):
                c = _held_rows(run, j, a, b)
        else:
            lo, hi = max(0, a - plan.halo), min(run.length, b + plan.halo)
            if j == 1:
                xs = self._sweep_input_windows(run, lo, hi, gate, trigger, reader)
            else:
                xs = [self._sweep_rows(run, j - 1, lo, hi, gate, trigger, reader, window)[1]]
            with on_device(reader.compute_device):
                padded = [slabs.halo_padded(x, plan, a, b, lo, hi) for x in xs]
                c = tf.nest.flatten(self._slab_call(conv, padded, conv.trainable)[0])[0]
                if j in run.held:
                    own = (window[0] - a, window[1] - a)
                    run.outputs[j].append(c if own == (0, c.shape[slabs.AXIS]) else slabs.rows(c, *own))
        with on_device(reader.compute_device):
            y = tf.nest.flatten(self._slab_call(bn, [c], bn.trainable, lambda x: (mean, variance))[0])[0]
            args, kwargs = common.rebuild(act.template, act.positions, [y])
            r, _, _ = adapter.run_stateless(act.unit, act.original, act.trainable, act.snapshot, args, kwargs,
                                            act.autocast)
        return c, tf.nest.flatten(r)[0]

    # ------------------------------------------------------------------ BatchNorm's first pass
    def _first_pass_piece(self, bn, c, g):
        """One window's share of BatchNorm's first pass: the gradients of its batch mean and variance and of its
        scale and offset, for output gradient rows ``g`` on input rows ``c`` (as ``_slab_moment_gradients``)."""
        mean, variance, _ = bn.moments[0]
        m, v = tf.identity(mean), tf.identity(variance)
        weights = list(bn.trainable)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([m, v] + weights)
            y = tf.nest.flatten(self._slab_call(bn, [c], bn.trainable, lambda x: (m, v))[0])[0]
        return tape.gradient(y, [m, v] + weights, output_gradients=g)

    @staticmethod
    def _hand_first_pass(run, j, parts):
        """Sum the windows' first-pass shares of BatchNorm j and hand them to its second pass and its backward."""
        bn = run.units[j - 1][1]
        mean, variance, _ = bn.moments[0]
        totals = [_sum([p[k] for p in parts]) for k in range(len(parts[0]))]
        run.first_pass[j] = TotalMoments(mean, variance, totals[0], totals[1], bn.moment_count)
        run.normalization_weights[j] = totals[2:]


def _held_rows(run, j, a, b):
    """Rows [a, b) of unit j's held convolution output, cut from the pieces of the windows they fall in."""
    return slabs.rows_of_pieces(run.outputs[j], run.bounds, a, b)


def pad_own_rows(x, begin: int, end: int):
    """``x`` with its rows outside [begin, end) zeroed: a window's gradient restricted to its slab's own rows."""
    return slabs.pad_rows(slabs.rows(x, begin, end), begin, x.shape[slabs.AXIS] - end)


def _sum(tensors):
    present = [t for t in tensors if t is not None]
    return tf.add_n(present) if present else None


def _unsweepable(records) -> str | None:
    """Why the step cannot run a sweep over these records (None: it can)."""
    if any(r is None for r in records) or len(records) % 3:
        return "a call of the run was not offloaded in this step"
    units = [records[k:k + 3] for k in range(0, len(records), 3)]
    length = units[0][0].slabs.length if units[0][0].slabs is not None else None
    for conv, bn, act in units:
        if conv.slabs is None or not conv.slabs.exact_rows or conv.slabs.length != length:
            return f"{conv.unit.name!r} is not computed in exact-row slabs"
        if bn.slabs is None or not bn.slabs.moments or bn.slabs.length != length or len(bn.moments) != 1 \
                or bn.moment_count is None:
            return f"{bn.unit.name!r} has no slab batch statistics"
        if output_gradients.input_gradient_from_output(act.unit) is None:
            return f"{act.unit.name!r} is not differentiated from its output"
        if any(r.n_outputs != 1 for r in (conv, bn, act)) or any(
                mask is not None for r in (conv, bn, act) for mask in r.masks):
            return "a call of the run has several outputs or masked inputs"
    first = units[0][0]
    if not (first.chain is not None and first.chain[1] is not None) and not all(
            host is not None or kept is not None for host, kept in zip(first.hosts, first.kept)):
        return f"{first.unit.name!r}'s input has no host copy"
    return None
