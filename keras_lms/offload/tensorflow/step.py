"""How a tensor goes to host and comes back on the TensorFlow back end: the step context and its per-call record.

For every offloaded layer call ``y = layer(x)`` (docs/design.md, "One training step"):

1. forward: ``y`` is computed by the layer's original ``call`` under a StatelessScope, inside a
   ``tf.custom_gradient`` function whose inputs are ``x`` and the layer's trainable values; the new
   non-trainable values (BatchNorm moving statistics, Dropout seed state) are assigned once, outside;
2. swap-out: a host op (``_HOST_OP``) under ``tf.device(host)``, once per tensor per step, shared by all consumers;
3. backward: the host copy is brought back by a host op that carries a control dependency on a gradient of the
   backward pass (this call's own gradient, or with ``prefetch=N`` the gradient of the call N calls later), so
   it cannot be sent during the forward pass; the layer is recomputed from the swapped-in inputs with the
   *snapshot* of its non-trainable values, and the VJP is taken under a local tape. TensorFlow prunes
   recompute ops that no gradient needs.
4. fused activations: for Dense/Conv-family layers whose activation's derivative is a function of its output
   (relu, sigmoid, tanh, elu), the gradient of the activation is taken from the layer's *output*, which is
   the next layer's offloaded input; the layer is then recomputed without its activation, so the forward
   convolution itself is never recomputed (only its input/filter gradients are computed).

The forward tensors the backward pass reads are then the host copies and small tensors only. The rest of the
back end (``tf_devices``, ``tf_tracing``, ``tf_output_gradients``) is re-exported here; ``StepContext`` looks the
output-gradient functions up in this module (tests replace them here to count their uses).
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from keras_lms import _keras_adapter as adapter
from keras_lms import policy
from keras_lms.offload import common
from keras_lms.offload import tf_slabs as slabs
from keras_lms.offload.common import offloadable_reason
from keras_lms.offload.tf_devices import (
    default_device,
    device_peak_bytes,
    executing_eagerly,
    reset_device_peak,
    validate_host_device,
)
from keras_lms.offload.tf_devices import on_device as _on_device
from keras_lms.offload.tf_output_gradients import fused_activation_grad, input_gradient_from_output, reads_own_output
from keras_lms.offload.tf_tracing import TENSOR_FACTS, example_inputs, signature_of, spec_for, trace_calls

__all__ = ["StepContext", "default_device", "device_peak_bytes", "example_inputs", "executing_eagerly",
           "fused_activation_grad", "input_gradient_from_output", "offloadable_reason", "reads_own_output",
           "reset_device_peak", "signature_of", "spec_for", "trace_calls", "validate_host_device"]

SWAP_OUT_NAME = "lms_swap_out"
SWAP_IN_NAME = "lms_swap_in"
GRAD_ARRIVAL_NAME = "lms_grad_arrival"
HOST_STAGE_SUFFIX = "host"


def _HOST_OP(tensor, name):
    """The op that holds a tensor on the host: ``EnsureShape`` (returns its input buffer, never copies).

    It must not be ``Identity``/``IdentityN``/``NoOp``: grappler's dependency optimiser removes those when that
    lowers the number of device crossings, and a host Identity between device ops is exactly that case.
    ``tests/test_executed_graph.py`` checks on the partitioned graph TensorFlow runs that the ops survive.
    """
    return tf.raw_ops.EnsureShape(input=tensor, shape=tensor.shape, name=name)


@dataclasses.dataclass
class _CallRecord:
    """One intercepted layer call whose backward we build: everything that backward needs, and nothing more.

    The gradient function closes over this record, so it holds no forward activation other than the host
    copies and the inputs deliberately kept on the device (in eager mode anything else would stay alive).
    """

    index: int
    unit: object
    original: object  # the unit's unpatched call
    template: object  # (args, kwargs) with the tensors blanked (common.template)
    positions: list
    hosts: list  # per input tensor: its host copy, or None when it stays on the device
    kept: list  # per input tensor: the device tensor when it stays there, else None
    masks: list
    trainable: list  # the trainable values the forward used (also inputs of the custom gradient)
    snapshot: list  # non-trainable values before the forward (same Dropout masks / BatchNorm statistics)
    compute_device: str | None
    kept_call: bool  # nothing offloaded: a kept call routed here because its gradient reads its own output
    autocast: str | None = None  # the autocast dtype of the forward call, re-entered by the recompute
    marker: tf.Tensor | None = None  # this call's gradient arrival (the trigger of prefetched swap-ins)
    moments: list = dataclasses.field(default_factory=list)  # BatchNorm (mean, variance) per _moments call
    n_outputs: int = 0
    output_key: object = None  # ref of the (first) output, to find the host copy a consumer made of it
    slabs: slabs.SlabPlan | None = None  # computed slab by slab (tf_slabs), or None: whole
    concatenated: bool = False  # the inputs are the parts of a channel concatenation the layer reads
    sources: list = dataclasses.field(default_factory=list)  # refs of the forward input tensors (slab forward)
    moment_count: tf.Tensor | None = None  # values per channel behind a slab BatchNorm's statistics


class StepContext(common.InterceptingContext):
    """State of one forward pass of a wrapped model in training mode.

    Lives as long as the backward pass of that step needs it (the gradient functions close over it).
    """

    def __init__(self, config, structure, plan, eager: bool):
        super().__init__(config, structure, plan, eager, host=validate_host_device(config.host_device))
        self.host_copies = {}  # tensor ref -> host tensor
        self.swap_ins = {}  # host tensor ref -> latest swapped-in device tensor
        self.records = {}  # call index -> _CallRecord (offloaded calls only)
        self.device_held = set()  # refs of tensors kept on the device by non-offloaded layers with weights
        self.concat_parts = {}  # ref of a channel concatenation's output -> the tensors it concatenates
        self.produced_at = {}  # tensor ref -> index of the call that produced it (graph mode)

    @staticmethod
    def tensor_bytes(tensor) -> int:
        return policy.tensor_bytes(tensor.shape, tensor.dtype)

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
            if self.eager or not reads_own_output(unit):
                outputs = original(*args, **kwargs)
                self._note_outputs(unit, tensors, outputs)
                return outputs
            # Kept inputs, but TensorFlow's own gradient would read this call's *output* on the device (a
            # fused relu/sigmoid/tanh/elu, a ReLU layer) and so keep it there even when the next layer offloads
            # it. Run it through the offload path with nothing offloaded: its backward then reads the
            # output's host copy when a consumer made one (see _swapped_in_output).
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
        instead (offloaded like the concatenation would have been), see tf_slabs.
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
                                slab_bytes)
        return plan, tensors, offload, False

    def swap_out(self, tensor):
        if self.eager:  # no cache: a ref-keyed cache would keep the device tensor alive until the step ends
            with tf.device(self.host):
                return tf.identity(tensor)
        key = tensor.ref()
        host = self.host_copies.get(key)
        if host is None:
            with tf.device(self.host):
                # Not tf.identity: grappler's dependency optimiser bypasses a host Identity between device ops
                # (fewer device crossings), which removed the whole offload in 0.1.0. See _HOST_OP.
                host = _HOST_OP(tensor, name=SWAP_OUT_NAME)
            self.host_copies[key] = host
        return host

    def _offloaded_call(self, index, unit, original, args, kwargs, tensors, decision):
        template, positions = common.template(args, kwargs, TENSOR_FACTS.is_tensor)
        plan, tensors, offload, concatenated = self._slab_inputs(unit, tensors, decision)
        n = len(tensors)
        is_layer = isinstance(unit, keras.layers.Layer)
        # Read values now: the snapshot must not see this step's state updates (same Dropout masks and
        # BatchNorm statistics in the recompute).
        trainable = [tf.convert_to_tensor(v) for v in adapter.raw_values(unit.trainable_variables)] if is_layer else []
        snapshot = ([tf.convert_to_tensor(v) for v in adapter.raw_values(unit.non_trainable_variables)]
                    if is_layer else [])
        masks = [adapter.get_mask(t) for t in tensors]
        record = _CallRecord(
            index=index, unit=unit, original=original, template=template, positions=positions,
            hosts=[self.swap_out(t) if off else None for t, off in zip(tensors, offload)],
            # Small tensors stay on the device and are read by the backward pass directly.
            kept=[None if off else t for t, off in zip(tensors, offload)],
            masks=masks, trainable=trainable, snapshot=snapshot,
            compute_device=next((t.device for t in tensors if t.device), None),
            kept_call=not decision.offloaded, autocast=adapter.current_autocast_dtype(),
            slabs=plan, concatenated=concatenated, sources=[t.ref() for t in tensors] if concatenated else [],
        )
        self.records[index] = record
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
                with _capture_moments(unit, record):
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
        self._note_outputs(unit, tensors, outputs)
        return outputs

    # ----------------------------------------------------------------- backward
    def _trigger(self, record):
        """The gradient tensor whose arrival starts this call's swap-in (prefetch calls ahead)."""
        for j in range(record.index + self.config.prefetch, record.index, -1):
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
        if trigger is None:
            staged = host
        else:
            with tf.device(self.host), tf.control_dependencies([trigger]):
                staged = _HOST_OP(host, name=f"{SWAP_IN_NAME}_{index}_{HOST_STAGE_SUFFIX}")
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
        if record.slabs is not None and not self.eager and upstream[0] is not None and len(upstream) == 1:
            result = self._slab_backward(record, upstream[0], trigger, foreign_variables)
            if result is not None:
                return result
        direct = input_gradient_from_output(unit)
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
                with _without_activation(unit, enabled=fused is not None), _reuse_moments(unit, record):
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
        activation_grad = fused_activation_grad(record.unit)
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
        y = self.swap_ins.get(host.ref())
        return y if y is not None else self.swap_in(host, trigger, record.compute_device, record.index)


    # -------------------------------------------------------------------- slabs
    def _slab_call(self, record, windows, values, moments=None):
        """Run the layer on slab ``windows`` (the parts of a concatenation are concatenated here)."""
        if record.concatenated:
            windows = [tf.concat(windows, -1)]
        call_args, call_kwargs = common.rebuild(record.template, record.positions, windows)
        with _given_moments(record.unit, moments):
            return adapter.run_stateless(record.unit, record.original, values, record.snapshot, call_args,
                                         call_kwargs, record.autocast)

    def _slab_forward(self, record, xs, values):
        """The forward of a slab-computed call (tf_slabs.forward); BatchNormalization's batch statistics first."""
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
        ``gate`` (the previous window) have run, then sent alone; a kept input is sliced on the device."""
        host = record.hosts[i]
        if host is None:
            with _on_device(record.compute_device), slabs.gated([gate]):
                return slabs.rows(record.kept[i], a, b)
        return self._host_window(host, a, b, [trigger, gate], record)

    def _host_window(self, host, a, b, gates, record, kind="bwd"):
        name = f"{SWAP_IN_NAME}_{record.index}_{kind}_rows{a}"
        with tf.device(self.host), slabs.gated(gates):
            staged = _HOST_OP(slabs.rows(host, a, b), name=f"{name}_{HOST_STAGE_SUFFIX}")
        with _on_device(record.compute_device):
            return tf.identity(staged, name=name)

    def _slab_backward(self, record, dy, trigger, foreign_variables):
        """The backward of a slab-computed call (tf_slabs.backward), or None to differentiate it whole."""
        unit, plan, device = record.unit, record.slabs, record.compute_device
        direct = input_gradient_from_output(unit)
        if direct is not None and len(record.hosts) == 1 and not record.trainable and foreign_variables is None:
            # An activation whose gradient reads its output: windows of the output's host copy (else whole).
            host = self.host_copies.get(record.output_key)
            if host is None or record.n_outputs != 1:
                return None

            def differentiate(windows, dy_inputs, _):
                with _on_device(device):
                    return [direct(windows[0], dy_inputs)], []

            inputs, _ = slabs.backward(plan, dy, lambda i, a, b, gate: self._host_window(
                host, a, b, [trigger, gate], record), differentiate, 1, 0)
            return inputs
        foreign = list(foreign_variables or [])
        weights = list(record.trainable) + foreign
        moments = None
        if plan.moments:
            if len(record.moments) != 1 or record.moment_count is None:
                return None
            moments = self._slab_moment_gradients(record, dy, trigger)

        def differentiate(windows, dy_inputs, dy_weights):
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
        inputs, weight_grads = slabs.backward(
            plan, dy, lambda i, a, b, gate: self._slab_window(record, i, a, b, gate if gate is not None else first_gate,
                                                                trigger),
            differentiate, len(record.hosts), len(weights))
        own = weight_grads[:len(record.trainable)]
        if foreign_variables is None:
            return inputs + own
        return inputs + own, weight_grads[len(record.trainable):]

    def _slab_moment_gradients(self, record, dy, trigger):
        """First pass of a BatchNormalization's slab backward: the gradient reaching its batch mean and variance,
        summed over slabs. Returns the moments function for the second pass (tf_slabs module docstring)."""
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
        return _TotalMoments(mean, variance, d_mean, d_variance, record.moment_count)


@contextlib.contextmanager
def _capture_moments(unit, record):
    """Record the batch statistics a BatchNormalization computes in the forward pass (per-channel, tiny)."""
    hook = adapter.batchnorm_moments_hook(unit)
    if hook is None:
        yield
        return
    original = getattr(unit, hook)

    def recording_moments(inputs, mask):
        mean, variance = original(inputs, mask)
        record.moments.append(None if mask is not None
                              else (mean, variance, adapter.batchnorm_reduction_axes(unit, inputs)))
        return mean, variance

    with adapter.patched_attribute(unit, hook, recording_moments):
        yield


@contextlib.contextmanager
def _reuse_moments(unit, record):
    """In the recompute, hand BatchNormalization its forward statistics instead of recomputing them.

    The gradient stays exact: ``tf.nn.moments`` computes the variance against ``stop_gradient(mean)``, so
    its gradient needs only the input and the mean's *value*, which the saved mean is. The reductions
    themselves are not recomputed (their outputs are not needed and TensorFlow prunes them).
    """
    hook = adapter.batchnorm_moments_hook(unit)
    if hook is None or not record.moments or any(m is None for m in record.moments):
        yield
        return
    original = getattr(unit, hook)
    saved = iter(record.moments)

    def saved_moments(inputs, mask):
        entry = next(saved, None)
        if entry is None or mask is not None:
            return original(inputs, mask)
        return _moments_with_exact_gradient(inputs, *entry)

    with adapter.patched_attribute(unit, hook, saved_moments):
        yield


def _moments_with_exact_gradient(x, mean, variance, axes):
    axes = list(axes)

    @tf.custom_gradient
    def moments(x):
        def grad(d_mean, d_variance):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(x)
                # The ops of tf.nn.moments(x, axes), with the saved mean behind its stop_gradient.
                kept_mean = tf.reduce_mean(x, axes, keepdims=True, name="mean")
                saved_mean = tf.reshape(mean, kept_mean.shape)
                kept_var = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(saved_mean)), axes,
                                          keepdims=True, name="variance")
                outs = [tf.squeeze(kept_mean, axes), tf.squeeze(kept_var, axes)]
            pairs = [(o, g) for o, g in zip(outs, (d_mean, d_variance)) if g is not None]
            if not pairs:
                return tf.zeros_like(x)
            return tape.gradient([o for o, _ in pairs], x, output_gradients=[g for _, g in pairs])

        return [tf.identity(mean), tf.identity(variance)], grad

    mean_out, variance_out = moments(x)
    return mean_out, variance_out


class _without_activation:
    """Temporarily replace a layer's activation by ``linear`` while its pre-activation is recomputed."""

    def __init__(self, unit, enabled: bool):
        self.unit, self.enabled, self.saved = unit, enabled, None

    def __enter__(self):
        if self.enabled:
            self.saved = adapter.fused_activation(self.unit)
            object.__setattr__(self.unit, "activation", keras.activations.linear)

    def __exit__(self, *exc):
        if self.enabled:
            object.__setattr__(self.unit, "activation", self.saved)


@contextlib.contextmanager
def _given_moments(unit, moments):
    """Within the block, BatchNormalization's batch statistics are ``moments(inputs)`` (None: its own)."""
    hook = adapter.batchnorm_moments_hook(unit)
    if moments is None or hook is None:
        yield
        return
    with adapter.patched_attribute(unit, hook, lambda inputs, mask: moments(inputs)):
        yield


class _TotalMoments:
    """BatchNormalization's batch statistics for the second pass of a slab backward: their values are the
    forward's, and the gradient they send to a slab's input is the one the *total* gradient of the mean and
    variance (summed over slabs in the first pass) sends there, computed as TensorFlow's gradients of
    ``reduce_mean`` (d_mean / n, broadcast) and ``squared_difference`` (2 * d_variance / n * (x - mean)) do."""

    def __init__(self, mean, variance, d_mean, d_variance, count):
        self.mean, self.variance, self.count = mean, variance, count
        self.d_mean, self.d_variance = d_mean, d_variance
        self.gate = d_mean  # the second pass starts once the first has finished

    def __call__(self, x):
        mean, variance, d_mean, d_variance, count = self.mean, self.variance, self.d_mean, self.d_variance, self.count

        @tf.custom_gradient
        def statistics(x):
            def grad(unused_d_mean, unused_d_variance):
                factor = tf.cast(count, x.dtype)  # the forward's count, in the forward's compute dtype
                from_mean = d_mean / factor
                from_variance = tf.math.scalar_mul(2.0, d_variance / factor) * (x - mean)
                return from_mean + from_variance

            return [tf.identity(mean), tf.identity(variance)], grad

        return statistics(x)
