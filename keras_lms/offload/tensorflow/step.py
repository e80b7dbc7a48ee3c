"""The TensorFlow back end's step context: one training forward pass of a wrapped model, and the backward of
every offloaded call in it (the mechanism: the package docstring, ``keras_lms.offload.tensorflow``)."""

from __future__ import annotations

import typing

import keras
import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.tensorflow import output_gradients, slabs
from keras_lms.offload.tensorflow.devices import on_device as _on_device
from keras_lms.offload.tensorflow.devices import validate_host_device
from keras_lms.offload.tensorflow.pooling_fold_calls import PoolingFoldCalls
from keras_lms.offload.tensorflow.recompute_scopes import capture_moments, reuse_moments, without_activation
from keras_lms.offload.tensorflow.recomputed_copies import RecomputedCopy, usable_producer
from keras_lms.offload.tensorflow.record import (
    GRAD_ARRIVAL_NAME,
    HOST_STAGE_SUFFIX,
    SWAP_IN_NAME,
    SWAP_OUT_NAME,
    CallRecord,
    host_op,
)
from keras_lms.offload.tensorflow.slab_calls import SlabCalls
from keras_lms.offload.tensorflow.sweep_calls import SweepCalls
from keras_lms.offload.tensorflow.tracing import TENSOR_FACTS
from keras_lms.planning import layer_facts
from keras_lms.planning.plan import lead_of, tensor_bytes


class _Reader(typing.NamedTuple):
    """Who reads a recomputed copy whole (its call index, for op names, and its compute device)."""

    index: int
    compute_device: str | None


class StepContext(SweepCalls, PoolingFoldCalls, SlabCalls, common.InterceptingContext):
    """State of one forward pass of a wrapped model in training mode.

    Lives as long as the backward pass of that step needs it (the gradient functions close over it).
    """

    def __init__(self, config, structure, plan, eager: bool):
        super().__init__(config, structure, plan, eager, host=validate_host_device(config.host_device))
        self.host_copies = {}  # tensor ref -> host tensor
        self.swap_ins = {}  # host tensor ref -> latest swapped-in device tensor
        self.records = {}  # call index -> CallRecord (offloaded calls only)
        self.device_held = set()  # refs of tensors kept on the device by non-offloaded layers with weights
        self.concat_parts = {}  # ref of a channel concatenation's output -> the tensors it concatenates
        self.produced_at = {}  # tensor ref -> index of the call that produced it (graph mode)
        self.folded_poolings = {}  # pooling call index -> the SweepRun whose pass A takes its input gradient
        self.pooling_folds = {}  # pooling call index -> the activation record whose backward takes it
        self.chain_windows = {}  # (call index, a, b) -> a fused chain's windows, for its further gradients
        # calls whose outputs the plan recomputes in windows instead of copying (recomputed_copies)
        self.recomputed_producers = {entry.index for entry in plan if entry.recomputed_output}
        self.output_records = {}  # ref of an offloaded call's (first) output -> its CallRecord

    @staticmethod
    def tensor_bytes(tensor) -> int:
        return tensor_bytes(tensor.shape, tensor.dtype)

    tensor_rank = staticmethod(TENSOR_FACTS.rank)

    # ------------------------------------------------------------------ forward
    def call(self, index, unit, original, args, kwargs):
        tensors = [leaf for leaf in tf.nest.flatten((args, kwargs)) if isinstance(leaf, tf.Tensor)]
        decision = self._decision(index, unit, tensors)
        if not decision.offloaded:
            if not self.eager and getattr(unit, "trainable_variables", None):
                # A kept layer with weights holds its inputs on the device for its weight gradient anyway;
                # its producer may read them there instead of recomputing (see _swapped_in_output).
                self.device_held.update(t.ref() for t in tensors)
            recomputed = not self.eager and index in self.recomputed_producers
            if not recomputed and (self.eager or not output_gradients.reads_own_output(unit)):
                outputs = original(*args, **kwargs)
                self._note_outputs(unit, tensors, outputs)
                return outputs
            # Kept inputs, but TensorFlow's own gradient would read this call's *output* on the device (a
            # fused relu/sigmoid/tanh/elu, a ReLU layer) and so keep it there even when the next layer offloads
            # it. Run it through the offload path with nothing offloaded: its backward then reads the
            # output's host copy when a consumer made one (see _swapped_in_output). Likewise an up-sampler whose
            # output the plan recomputes from its kept input (recomputed_copies): its record is the recipe.
        return self._offloaded_call(index, unit, original, args, kwargs, tensors, decision)

    def _note_outputs(self, unit, tensors, outputs):
        """Remember a channel concatenation's parts, so that a slab-computed consumer reads them instead, and
        which call produced each output (a slab forward reads parts older than the newest from the host)."""
        for out in tf.nest.flatten(outputs):
            if isinstance(out, tf.Tensor):
                self.produced_at[out.ref()] = self.index
        if (self.config.slab_bytes and type(unit) is keras.layers.Concatenate and isinstance(outputs, tf.Tensor)
                and len(tensors) > 1 and adapter.get_mask(outputs) is None
                and unit.axis % len(outputs.shape) == len(outputs.shape) - 1):
            self.concat_parts[outputs.ref()] = list(tensors)

    def _slab_inputs(self, unit, tensors, decision):
        """(slab plan or None, the call's input tensors, per-tensor offload flags, concatenated?).

        A slab-computed call whose single input is a channel concatenation takes the concatenated tensors
        instead (offloaded like the concatenation would have been), see slabs.
        """
        offload = list(decision.offload_tensor)
        slab_bytes = self.config.slab_bytes if decision.slab_bytes is None else decision.slab_bytes
        if self.eager or not slab_bytes or any(adapter.get_mask(t) is not None for t in tensors):
            return None, tensors, offload, False
        parts = self.concat_parts.get(tensors[0].ref()) if len(tensors) == 1 else None
        if parts is not None and decision.offloaded and not isinstance(unit, keras.layers.BatchNormalization):
            plan = slabs.plan_slabs(unit, [list(p.shape) for p in parts], sum(self.tensor_bytes(p) for p in parts),
                                    slab_bytes)
            if plan is not None:
                return plan, list(parts), offload * len(parts), True
        plan = slabs.plan_slabs(unit, [list(t.shape) for t in tensors], sum(self.tensor_bytes(t) for t in tensors),
                                slab_bytes, self._output_bytes(unit, tensors))
        return plan, tensors, offload, False

    @staticmethod
    def _output_bytes(unit, tensors) -> int:
        """Bytes of a single-input convolution's output, from its input's static shape (``plan_slabs`` cuts a
        convolution by the larger of its input and output, as the planner's ``slab_plans`` does); 0 otherwise."""
        if len(tensors) != 1 or not slabs.computes_in_slabs_forward(unit):
            return 0
        try:
            shape = unit.compute_output_shape(tuple(tensors[0].shape))
        except (ValueError, TypeError, NotImplementedError):
            return 0
        return tensor_bytes(shape, unit.compute_dtype)

    @staticmethod
    def _upsampling(unit, tensors, plan):
        """(scale, output rows) of a whole-computed up-sampler whose output windows can be recomputed from its
        input's (``recomputed_copies``); None for any other call."""
        if plan is not None or len(tensors) != 1 or tensors[0].shape.rank is None:
            return None
        scale = layer_facts.upsampling_scale(unit, tensors[0].shape.rank)
        rows = tensors[0].shape[slabs.AXIS]
        return None if scale is None or rows is None else (scale, scale * rows)

    def swap_out(self, tensor):
        if self.eager:  # no cache: a ref-keyed cache would keep the device tensor alive until the step ends
            with tf.device(self.host):
                return tf.identity(tensor)
        key = tensor.ref()
        host = self.host_copies.get(key)
        if host is None and self.recomputed_producers:
            producer = self.output_records.get(key)
            if producer is not None and producer.index in self.recomputed_producers and usable_producer(producer):
                host = self.host_copies[key] = RecomputedCopy(producer)
        if host is None:
            with tf.device(self.host):
                # Not tf.identity: grappler's dependency optimiser bypasses a host Identity between device ops
                # (fewer device crossings), which removed the whole offload in 0.1.0. See _HOST_OP.
                host = host_op(tensor, name=SWAP_OUT_NAME)
            self.host_copies[key] = host
        return host

    def _offloaded_call(self, index, unit, original, args, kwargs, tensors, decision):
        template, positions = common.template(args, kwargs, TENSOR_FACTS.is_tensor)
        plan, tensors, offload, concatenated = self._slab_inputs(unit, tensors, decision)
        plan = self._planned_alignment(decision, plan)  # (before the chain's check: the planner's windows)
        n = len(tensors)
        is_layer = isinstance(unit, keras.layers.Layer)
        # Read values now: the snapshot must not see this step's state updates (same Dropout masks and
        # BatchNorm statistics in the recompute).
        trainable = [tf.convert_to_tensor(v) for v in adapter.raw_values(unit.trainable_variables)] if is_layer else []
        snapshot = ([tf.convert_to_tensor(v) for v in adapter.raw_values(unit.non_trainable_variables)]
                    if is_layer else [])
        masks = [adapter.get_mask(t) for t in tensors]
        chain = self._chain(decision, plan, tensors, concatenated)
        if chain is not None and chain[1] is not None:
            offload = [False]  # recomputed from the chain's BatchNorm input copy: no copy, nothing kept
        record = CallRecord(
            index=index, unit=unit, original=original, template=template, positions=positions,
            hosts=[self.swap_out(t) if off else None for t, off in zip(tensors, offload)],
            # Small tensors stay on the device and are read by the backward pass directly.
            kept=[None if off else t for t, off in zip(tensors, offload)],
            masks=masks, trainable=trainable, snapshot=snapshot,
            compute_device=next((t.device for t in tensors if t.device), None),
            kept_call=not decision.offloaded, autocast=adapter.current_autocast_dtype(),
            slabs=plan, concatenated=concatenated, sources=[t.ref() for t in tensors] if concatenated else [],
            chain=chain, upsampling=self._upsampling(unit, tensors, plan),
        )
        if chain is not None and chain[1] is not None:
            record.kept = [None]
        self.records[index] = record
        self._check_folded_pooling(index, unit, tensors)
        self._bind_pooling_fold(record, decision, tensors)
        forward = {}

        @tf.custom_gradient
        def offloaded_forward(*flat):
            xs, values = list(flat[:n]), list(flat[n:])
            for x, mask in zip(xs, masks):
                adapter.set_mask(x, mask)
            if plan is not None and (plan.moments or concatenated or slabs.computes_in_slabs_forward(unit)):
                outputs, new_state, losses = self._slab_forward(record, xs, values)
            else:
                call_args, call_kwargs = common.rebuild(template, positions, xs)
                with capture_moments(unit, record):
                    outputs, new_state, losses = adapter.run_stateless(unit, original, values, snapshot, call_args,
                                                                       call_kwargs, record.autocast)
            flat_outputs = tf.nest.flatten(outputs)
            forward.update(outputs=outputs, new_state=new_state)
            record.n_outputs = len(flat_outputs)

            def grad_fn(*upstream, variables=None):
                # TensorFlow passes ``variables`` only when the layer read variables that are not its own
                # (e.g. tied weights); their gradients are then returned as well.
                return self._backward(record, upstream, variables)

            return flat_outputs + list(losses), grad_fn

        flat_results = offloaded_forward(*tensors, *trainable)
        n_out = record.n_outputs
        outputs = tf.nest.pack_sequence_as(forward["outputs"], list(flat_results[:n_out]))
        for original_out, new_out in zip(tf.nest.flatten(forward["outputs"]), flat_results[:n_out]):
            adapter.set_mask(new_out, adapter.get_mask(original_out))
        for loss in flat_results[n_out:]:
            unit.add_loss(loss)
        if is_layer:
            for var, old, new in zip(unit.non_trainable_variables, snapshot, forward["new_state"]):
                if new is not old:
                    var.assign(new)
        record.output_key = None if self.eager else flat_results[0].ref()
        if record.output_key is not None:
            self.output_records[record.output_key] = record
        self._note_outputs(unit, tensors, outputs)
        if decision.sweep is not None and index == decision.sweep[-1] and not self.eager:
            self._bind_sweep(decision.sweep, decision.sweep_windows, decision.sweep_held, decision.sweep_folded)
        return outputs

    def _chain(self, decision, plan, tensors, concatenated):
        """(BatchNorm record, activation record) when the plan fuses this call's input (slab_chains) and the
        step has what the fused backward needs; None (copy as usual) otherwise."""
        if decision.recompute_from is None or plan is None or concatenated or len(tensors) != 1:
            return None
        source_index, between_index = decision.recompute_from
        source = self.records.get(source_index)
        between = None if between_index is None else self.records.get(between_index)
        produced = getattr(source if between_index is None else between, "output_key", None)
        if (source is None or (between_index is not None and between is None) or source.slabs is None
                or not source.slabs.moments or source.slabs.bounds != plan.bounds or source.hosts[0] is None
                or len(source.moments) != 1 or source.moment_count is None or produced != tensors[0].ref()):
            return None
        return source, between

    # ----------------------------------------------------------------- backward
    def _trigger(self, record):
        """The gradient tensor whose arrival starts this call's swap-in (its lead of calls ahead: the plan's
        prefetch depth, or the call's own, ``PlanEntry.copy_back_lead``)."""
        for j in range(record.index + lead_of(self.leads, record.index), record.index, -1):
            other = self.records.get(j)
            if other is not None and other.marker is not None:
                return other.marker
        return record.marker

    def swap_in(self, host, trigger, device, index):
        """Bring a host copy back to the compute device once the backward pass reaches ``trigger``.

        The wait must sit on the *host* side: a cross-device edge becomes a ``_Send``/``_Recv`` pair and the
        device-side ``_Recv`` has no inputs, so a control dependency after it gates nothing and the copy would
        arrive (and occupy the device) during the forward pass. Here a host op that carries the dependency on
        the trigger produces the tensor that is sent, so the transfer cannot start before the trigger runs.
        """
        if self.eager:
            with tf.device(device):
                return tf.identity(host)
        if isinstance(host, RecomputedCopy):  # a reader the plan did not expect to read windows: all rows
            return self._whole_recomputed(host, [trigger], _Reader(index, device))
        if trigger is None:
            staged = host
        else:
            with tf.device(self.host), tf.control_dependencies([trigger]):
                staged = host_op(host, name=f"{SWAP_IN_NAME}_{index}_{HOST_STAGE_SUFFIX}")
        with _on_device(device):
            dev = tf.identity(staged, name=f"{SWAP_IN_NAME}_{index}")
        self.swap_ins[host.ref()] = dev
        return dev

    def _backward(self, record, upstream, foreign_variables=None):
        upstream = list(upstream)
        unit, device = record.unit, record.compute_device
        arrived = next((g for g in upstream if g is not None), None)
        trigger = None
        if not self.eager and arrived is not None:
            with _on_device(device):
                record.marker = tf.identity(arrived, name=f"{GRAD_ARRIVAL_NAME}_{record.index}")
            trigger = self._trigger(record)
        if record.index in self.folded_poolings:
            return self._fold_into_sweep(self.folded_poolings[record.index], record, upstream[0])
        if record.index in self.pooling_folds:
            handed = self._hand_pooling_gradient(record, upstream[0])
            if handed is not None:
                return handed
        self._check_pooling_fold_taken(record, upstream)
        if record.sweep is not None:
            return self._sweep_backward(record, upstream[0], trigger, foreign_variables)
        if record.fused_gradient is not None:
            # an activation of a fused chain: its consumer's backward took its gradient (slab_chains), from the
            # same upstream gradient (it is the only consumer)
            return [record.fused_gradient]
        if record.slabs is not None and not self.eager and upstream[0] is not None and len(upstream) == 1:
            result = self._slab_backward(record, upstream[0], trigger, foreign_variables)
            if result is not None:
                return result
        direct = output_gradients.input_gradient_from_output(unit)
        if (direct is not None and foreign_variables is None and len(record.hosts) == 1 and not record.trainable
                and upstream[0] is not None):
            y = self._swapped_in_output(record, trigger)
            if y is not None:
                with _on_device(device):
                    return [direct(y, upstream[0])]
        xs = []
        for i, mask in enumerate(record.masks):
            x = self._input(record, i, trigger)
            adapter.set_mask(x, mask)
            xs.append(x)

        fused = self._fused_output_gradient(record, upstream, trigger)
        if fused is not None:
            upstream = [fused] + upstream[1:]
        foreign = list(foreign_variables or [])
        differentiable = [x for x in xs if x.dtype.is_floating or x.dtype.is_complex]
        sources = differentiable + list(record.trainable) + foreign
        call_args, call_kwargs = common.rebuild(record.template, record.positions, xs)
        with _on_device(device):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(sources)
                with without_activation(unit, enabled=fused is not None), reuse_moments(unit, record):
                    outputs, _, losses = adapter.run_stateless(unit, record.original, record.trainable,
                                                               record.snapshot, call_args, call_kwargs,
                                                               record.autocast)
            targets = tf.nest.flatten(outputs) + list(losses)
            pairs = [(t, g) for t, g in zip(targets, upstream) if g is not None]
            if not pairs:
                grads = [None] * len(sources)
            else:
                grads = tape.gradient([t for t, _ in pairs], sources, output_gradients=[g for _, g in pairs])
        grads = list(grads)
        variable_grads = grads[len(grads) - len(foreign):]
        grads = iter(grads[:len(grads) - len(foreign)])
        input_grads = [next(grads) if (x.dtype.is_floating or x.dtype.is_complex) else None for x in xs]
        if foreign_variables is None:
            return input_grads + list(grads)
        return input_grads + list(grads), variable_grads

    def _input(self, record, i, trigger):
        """Input ``i`` of the call for its backward: the kept device tensor, or its host copy brought back."""
        host = record.hosts[i]
        if host is None:
            return record.kept[i]
        return self.swap_in(host, trigger, record.compute_device, record.index)

    def _fused_output_gradient(self, record, upstream, trigger):
        """d(activation) from the layer output's host copy (see module docstring, point 4), or None."""
        activation_grad = output_gradients.fused_activation_grad(record.unit)
        if activation_grad is None or upstream[0] is None:
            return None
        y = self._swapped_in_output(record, trigger)
        if y is None:
            return None
        with _on_device(record.compute_device):
            return activation_grad(y, upstream[0])

    def _swapped_in_output(self, record, trigger):
        """The call's (single) output brought back from the host copy its consumer made, or None.

        Reuses the consumer's swap-in when there is one (the consumer's backward ran just before ours). When
        a kept layer with weights consumes the output, it is on the device anyway and is read there. Otherwise
        (eager mode, or a consumer that keeps nothing) the caller recomputes.
        """
        if self.eager or record.n_outputs != 1:
            return None
        host = self.host_copies.get(record.output_key)
        if host is None:
            # No consumer offloaded the output: it is on the device anyway when a kept consumer with weights
            # holds it, or when this call is kept (as the plain model's gradient would read it there).
            on_device = record.output_key in self.device_held or record.kept_call
            return record.output_key.deref() if on_device else None
        y = None if isinstance(host, RecomputedCopy) else self.swap_ins.get(host.ref())
        return y if y is not None else self.swap_in(host, trigger, record.compute_device, record.index)
