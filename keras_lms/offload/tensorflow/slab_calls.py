"""The TensorFlow step context's slab-computed calls (``StepContext`` inherits them): the forward and backward of
an offloaded call one slab of its first spatial axis at a time, with its windows cut from host copies on the
host (the mechanism and why: ``slabs``)."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.tensorflow import output_gradients, slab_rows, slabs
from keras_lms.offload.tensorflow.devices import on_device as _on_device
from keras_lms.offload.tensorflow.recompute_scopes import TotalMoments, given_moments
from keras_lms.offload.tensorflow.recomputed_copies import RecomputedCopy, RecomputedWindows, when_reader_runs
from keras_lms.offload.tensorflow.record import HOST_STAGE_SUFFIX, SWAP_IN_NAME, host_op


class SlabCalls(RecomputedWindows):
    """Slab-wise forward and backward of a ``CallRecord`` whose ``slabs`` is set (a mixin of ``StepContext``:
    it reads the context's ``host``, ``host_copies`` and ``produced_at``)."""

    def _slab_call(self, record, windows, values, moments=None):
        """Run the layer on slab ``windows`` (the parts of a concatenation are concatenated here). An exact-rows
        convolution (``slab_rows``) takes windows of ``s1 - s0 + 2h`` rows and returns rows [s0, s1)."""
        if record.concatenated:
            windows = [tf.concat(windows, -1)]
        exact = record.slabs is not None and record.slabs.exact_rows
        if exact:
            windows = [slab_rows.padded(w, record.unit, 0, 0) for w in windows]
        call_args, call_kwargs = common.rebuild(record.template, record.positions, windows)
        with given_moments(record.unit, moments), (adapter.valid_convolution(record.unit) if exact
                                                   else contextlib.nullcontext()):
            return adapter.run_stateless(record.unit, record.original, values, record.snapshot, call_args,
                                         call_kwargs, record.autocast)

    def _exact_input_gradients(self, record, windows, dy):
        """An exact-rows convolution's input gradient of the window's rows from ``dy``, the output gradient's
        same rows (``slab_rows.input_gradient``; slabs.backward crops it), split into the parts of a
        concatenated input."""
        grad, _, _ = adapter.run_stateless(record.unit, lambda g: slab_rows.input_gradient(record.unit, g),
                                           record.trainable, record.snapshot, (dy,), {}, record.autocast)
        if len(windows) == 1:
            return [tf.cast(grad, windows[0].dtype)]
        parts = tf.split(grad, [w.shape[-1] for w in windows], axis=-1)
        return [tf.cast(g, w.dtype) for g, w in zip(parts, windows)]

    def _slab_forward(self, record, xs, values):
        """The forward of a slab-computed call (slabs.forward); BatchNormalization's batch statistics first."""
        plan, moments = record.slabs, None
        if plan.moments:
            compute_dtype = keras.backend.result_type(xs[0].dtype.name, "float32")
            axes = adapter.batchnorm_reduction_axes(record.unit, xs[0])
            mean, variance, count = slabs.global_moments(xs[0], plan, axes, compute_dtype)
            record.moments.append((mean, variance, axes))
            record.moment_count = count
            moments = lambda x: (mean, variance)  # noqa: E731
        newest = max(range(len(xs)), key=lambda i: self.produced_at.get(record.sources[i], -1)
                     if record.concatenated else 0)

        def window_of(i, a, b, gate):
            if record.concatenated and i != newest and record.hosts[i] is not None:
                # an older part (a skip tensor): from its host copy, once the newest part exists
                return self._host_window(record.hosts[i], a, b, [gate, xs[newest]], record, "fwd")
            with _on_device(record.compute_device), slabs.gated([gate]):
                return slabs.rows(xs[i], a, b)

        return slabs.forward(lambda windows: self._slab_call(record, windows, values, moments), window_of, len(xs),
                             plan)

    def _slab_window(self, record, i, a, b, gate, trigger):
        """Rows [a, b) of input ``i`` on the device: cut from its host copy on the host once ``trigger`` and
        ``gate`` (the previous window) have run, then sent alone; a kept input is sliced on the device; a fused
        chain's input is recomputed from its BatchNorm input's window (``_chain_window``)."""
        if record.chain is not None and record.chain[1] is not None:
            return self._chain_window(record, a, b, gate, trigger)
        host = record.hosts[i]
        if host is None:
            with _on_device(record.compute_device), slabs.gated([gate]):
                return slabs.rows(record.kept[i], a, b)
        return self._host_window(host, a, b, [trigger, gate], record)

    def _chain_window(self, record, a, b, gate, trigger):
        """Rows [a, b) of a fused chain's activation output (slab_chains), ``_chain_input_window``; the
        BatchNorm input's rows are kept for the chain's further gradients (``_chain_gradients``)."""
        c, activated = self._chain_input_window(record, a, b, [trigger, gate], record, "bwd")
        self.chain_windows[(record.index, a, b)] = (c, activated)
        return activated

    def _chain_input_window(self, record, a, b, gates, reader, kind):
        """(BatchNorm input rows, activation output rows) [a, b) of ``record``'s fused chain: the window of the
        BatchNorm input's host copy (or its recomputed window), sent alone as any window, then normalised with
        the forward's batch statistics and activated on ``reader``'s device, by the layers' own calls."""
        source, between = record.chain
        between = between or record  # BatchNorm -> activation: this call's own output
        c = when_reader_runs([self._host_window(source.hosts[0], a, b, gates, reader, kind)], reader)[0]
        mean, variance, _ = source.moments[0]
        with _on_device(reader.compute_device):
            outputs, _, _ = self._slab_call(source, [c], source.trainable, lambda x: (mean, variance))
            args, kwargs = common.rebuild(between.template, between.positions, [tf.nest.flatten(outputs)[0]])
            activated, _, _ = adapter.run_stateless(between.unit, between.original, between.trainable,
                                                    between.snapshot, args, kwargs, between.autocast)
        return c, tf.nest.flatten(activated)[0]

    def _chain_gradients(self, record):
        """``on_piece`` for a fused chain's convolution (slabs.backward): per slab, the activation's input
        gradient from the recomputed output rows and the convolution's exact input-gradient rows, and the
        BatchNorm's first-pass gradient of its batch mean and variance on the same rows (as
        ``_slab_moment_gradients`` computes it). After the last slab ``finish()`` hands the activation its
        gradient and the BatchNorm its totals."""
        source, between = record.chain
        direct = None if between is None else output_gradients.input_gradient_from_output(between.unit)
        mean, variance, _ = source.moments[0]
        activation_pieces, mean_parts, variance_parts = [], [], []

        def on_piece(s0, s1, a, b, pieces):
            c, activated = self.chain_windows.pop((record.index, a, b))
            with _on_device(record.compute_device):
                inner = (s0 - a, s1 - a)
                # a convolution's piece is its input's gradient (the activation's output); an activation's is
                # already the gradient of BatchNorm's output
                d_normalized = pieces[0] if direct is None else direct(slabs.rows(activated, *inner), pieces[0])
                m, v = tf.identity(mean), tf.identity(variance)
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch([m, v])
                    outputs, _, _ = self._slab_call(source, [slabs.rows(c, *inner)], source.trainable,
                                                    lambda x: (m, v))
                d_mean, d_variance = tape.gradient(tf.nest.flatten(outputs)[0], [m, v],
                                                   output_gradients=d_normalized)
            activation_pieces.append(d_normalized)
            mean_parts.append(d_mean)
            variance_parts.append(d_variance)
            # the next windows wait for this slab's first-pass gradient (it reads the window and the piece), so
            # the scheduler cannot keep windows alive for a late first pass
            return [d_mean, d_variance, d_normalized]

        def finish():
            if between is not None:
                between.fused_gradient = tf.concat(activation_pieces, slabs.AXIS)
            source.fused_moments = TotalMoments(mean, variance, tf.add_n(mean_parts), tf.add_n(variance_parts),
                                                source.moment_count)

        return on_piece, finish

    def _host_window(self, host, a, b, gates, record, kind="bwd"):
        """Rows [a, b) of a host copy on ``record``'s device, cut on the host after ``gates`` (or recomputed,
        for a ``RecomputedCopy``)."""
        if isinstance(host, RecomputedCopy):
            return self._recomputed_window(host, a, b, gates, record, kind)
        name = f"{SWAP_IN_NAME}_{record.index}_{kind}_rows{a}"
        with tf.device(self.host), slabs.gated(gates):
            staged = host_op(slabs.rows(host, a, b), name=f"{name}_{HOST_STAGE_SUFFIX}")
        with _on_device(record.compute_device):
            return tf.identity(staged, name=name)

    @staticmethod
    def _output_gradient_kernel(record):
        """A weightless activation's output-based gradient (``output_gradients``) when it has one input, else
        None: the calls whose slab backward reads only their output's windows."""
        direct = output_gradients.input_gradient_from_output(record.unit)
        return direct if direct is not None and len(record.hosts) == 1 and not record.trainable else None

    def _reads_output_windows(self, record) -> bool:
        """Whether such a call's one output can be read in windows: its host copy, or a fused chain's windows
        recomputed from its BatchNorm's input copy (slab_chains)."""
        return record.n_outputs == 1 and (record.chain is not None
                                          or self.host_copies.get(record.output_key) is not None)

    def _slab_backward(self, record, dy, trigger, foreign_variables):
        """The backward of a slab-computed call (slabs.backward), or None to differentiate it whole."""
        plan, device = record.slabs, record.compute_device
        direct = self._output_gradient_kernel(record)
        if direct is not None and foreign_variables is None:
            # An activation whose gradient reads its output: windows of the output's host copy (else whole), or,
            # after a BatchNorm it fuses with (slab_chains), its output recomputed from the BatchNorm input's
            # windows, which also give BatchNorm's first backward pass.
            if not self._reads_output_windows(record):
                return None
            host = self.host_copies.get(record.output_key)

            bounds = iter(plan.bounds)  # (one call per slab, in order)

            def differentiate(windows, dy_inputs, _):
                s0, s1 = next(bounds)
                with _on_device(device):
                    if record.pooling_fold is not None:  # a folded pooling's share of the gradient (pooling_folds)
                        dy_inputs = dy_inputs + self._pooling_rows(record, windows[0], s0, s1)
                    return [direct(windows[0], dy_inputs)], []

            if record.chain is not None:
                on_piece, finish = self._chain_gradients(record)
                inputs, _ = slabs.backward(plan, dy, lambda i, a, b, gate: self._chain_window(
                    record, a, b, gate, trigger), differentiate, 1, 0, on_piece)
                finish()
                return inputs
            inputs, _ = slabs.backward(plan, dy, lambda i, a, b, gate: self._host_window(
                host, a, b, [trigger, gate], record), differentiate, 1, 0)
            return inputs
        foreign = list(foreign_variables or [])
        weights = list(record.trainable) + foreign
        moments = None
        if plan.moments:
            if len(record.moments) != 1 or record.moment_count is None:
                return None
            # a fused chain's convolution took the first pass on its own windows (slab_chains)
            moments = (record.fused_moments if record.fused_moments is not None
                       else self._slab_moment_gradients(record, dy, trigger))

        def differentiate(windows, dy_inputs, dy_weights):
            if plan.exact_rows:  # slab_rows: the weights from the "valid" call, the inputs from dy alone
                with _on_device(device):
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch(weights)
                        outputs, _, _ = self._slab_call(record, windows, record.trainable, moments)
                    weight_grads = tape.gradient(tf.nest.flatten(outputs)[0], weights, output_gradients=dy_weights)
                    return self._exact_input_gradients(record, windows, dy_inputs), weight_grads
            with _on_device(device):
                with tf.GradientTape(persistent=dy_inputs is not dy_weights, watch_accessed_variables=False) as tape:
                    tape.watch(windows + weights)
                    outputs, _, _ = self._slab_call(record, windows, record.trainable, moments)
                y = tf.nest.flatten(outputs)[0]
                if dy_inputs is dy_weights:
                    grads = tape.gradient(y, windows + weights, output_gradients=dy_inputs)
                    return grads[:len(windows)], grads[len(windows):]
                return (tape.gradient(y, windows, output_gradients=dy_inputs),
                        tape.gradient(y, weights, output_gradients=dy_weights))

        first_gate = moments.gate if moments is not None else None
        on_piece, finish = self._chain_gradients(record) if record.chain is not None else (None, None)
        inputs, weight_grads = slabs.backward(
            plan, dy, lambda i, a, b, gate: self._slab_window(record, i, a, b, gate if gate is not None else first_gate,
                                                                trigger),
            differentiate, len(record.hosts), len(weights), on_piece, self._fenced_gradients(record))
        if finish is not None:
            finish()
        own = weight_grads[:len(record.trainable)]
        if foreign_variables is None:
            return inputs + own
        return inputs + own, weight_grads[len(record.trainable):]

    def _fenced_gradients(self, record):
        """Per input, whether its gradient pieces get a layout fence before their concatenation (slabs.layout_fence):
        not for a part of a concatenation whose producer runs whole (a U-Net's up-sampling, a transposed
        convolution). That gradient is read whole by three ops the layout optimiser runs channels-first (the
        bias, input and filter gradients); assembled channels-last from fenced pieces, it got one whole-size
        transpose per op before grappler's memory pass: 19.1 GiB estimated at 400^3 float32 (16.75 without),
        and with exact-row slabs one swap of that 3.8 GiB gradient, which in one run of two took the executed
        peak from 15.8 to 16.7 GiB. Unfenced, the optimiser assembles it channels-first from window-sized
        transposes (tests/offload/tensorflow/test_layout_fence.py)."""
        if not record.concatenated:
            return None
        fenced = []
        for ref in record.sources:
            producer = self.records.get(self.produced_at.get(ref, -1))
            fenced.append(producer is None or producer.slabs is not None)
        return fenced

    def _slab_moment_gradients(self, record, dy, trigger):
        """First pass of a BatchNormalization's slab backward: the gradient reaching its batch mean and variance,
        summed over slabs. Returns the moments function for the second pass (slabs module docstring)."""
        mean, variance, _ = record.moments[0]
        device = record.compute_device

        def differentiate(windows, dy_inputs, _):
            with _on_device(device):
                m, v = tf.identity(mean), tf.identity(variance)
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch([m, v])
                    outputs, _, _ = self._slab_call(record, windows, record.trainable, lambda x: (m, v))
                return [], tape.gradient(tf.nest.flatten(outputs)[0], [m, v], output_gradients=dy_inputs)

        _, (d_mean, d_variance) = slabs.backward(
            record.slabs, dy, lambda i, a, b, gate: self._slab_window(record, i, a, b, gate, trigger),
            differentiate, 1, 2)
        return TotalMoments(mean, variance, d_mean, d_variance, record.moment_count)
