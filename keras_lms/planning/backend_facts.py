"""How a back end's training step holds device memory: the facts the planner and the report need of it.

The memory model (``memory_model.simulate``) is one model for every back end; what differs between frameworks
is a list of facts: which activations a framework differentiates from their *output*, what autograd saves
besides a layer's inputs, whether an offloaded call is recomputed, the temporaries of its kernels, the
optimizer update's. ``BackendFacts`` names each of them once, with the defaults of a framework that keeps
exactly what a layer's gradient reads and nothing more. A back end subclasses it in its offload package
(``keras_lms/offload/<name>/step_memory.py``) and hands an instance to the planner through the back-end
contract (``keras_lms.offload.Backend.memory_facts``). Planning never asks which back end runs, so a third
back end adds a module, not ``if`` branches (tests/planning/fake_backend.py is one; tests/planning/test_step.py
plans with it).
"""

from __future__ import annotations

import typing

from keras_lms.planning import layer_facts


class EagerBytes(typing.NamedTuple):
    """A call's memory-bound bytes (read plus written) per pass, as a back end's unfused kernels move them:
    element-wise and reduction work at the profile's HBM rate, strided layout copies at its layout-copy rate."""

    forward_bytes: float
    backward_bytes: float
    forward_layout_bytes: float = 0.0
    backward_layout_bytes: float = 0.0


class SweepTiming(typing.NamedTuple):
    """When a level sweep runs its passes (``BackendFacts.sweep_timing``), for where the memory model puts the
    copies back that its calls trigger or read."""

    passes: frozenset = frozenset()  # calls whose backward runs a pass (long: it convolves)
    handed: dict = {}  # call -> the call at whose backward start its upstream gradient (its trigger) exists
    first_pass: int | None = None  # the call whose backward runs the first pass
    early_bytes: int = 0  # what the first pass holds from its prefetched windows' arrival until it runs
    summed: frozenset = frozenset()  # tensors whose gradient parts a pass adds window by window (no whole sum)


class BackendFacts:
    """The memory facts of a back end's training step (the defaults: a framework that saves what gradients read).

    Attributes:
        output_gradient_activations: activation names (Keras' ``relu``, ``sigmoid``, ...) whose gradient the
            framework computes from the activation's output, so a standalone activation layer keeps only its
            output (and the back end's offload reads it from the next layer's host copy).
        shape_only_layers: Keras classes whose gradient reads no tensor values, only shapes.
        fused_activation_reads_output_copy: the wrapped backward of a Dense/Conv-family call with such a fused
            activation reads the call's output from its consumer's host copy (instead of recomputing it).
        recomputes_offloaded_calls: every offloaded call recomputes its output in its backward (not only max
            pooling, whose output the gradient reads).
        copy_back_allocated_at_trigger: a prefetched copy back holds its device memory from the moment the
            trigger's backward issues it (an allocator on the compute stream), not from when it lands.
        concatenate_gradient_is_view: a concatenation's input gradients are views of its output gradient.
        gradients_wait_between_readers: the gradient of a tensor read by several calls arrives in parts, one
            per reader's backward, and the first part waits on the device until the last has been added (a U-Net
            skip tensor's, from the decoder's backward down to the encoder's): autograd's input buffer (torch),
            the tape's pending gradients (TensorFlow).
        gradient_sum_allocated: those parts are summed into a new buffer (TensorFlow's ``AddN``) when the last
            one arrives: the sum exists beside both parts in that reader's backward (torch adds in place).
        weight_gradients_from_their_backward: a weight's gradient exists only from its layer's backward on (torch:
            ``zero_grad()`` drops the previous step's before the forward pass ends).
        plain_model_keeps_layer_outputs: without keras-lms, Keras' functional model keeps every layer output
            until its forward pass returns.
        shared_copy_stream: the offload queues copies in both directions on one stream, so they run one at a
            time in issue order (the step-time model's link then has one engine, not one per direction).
        starts_copies_back_per_call: the step starts each call's copy back where the plan says, one lead per call
            (``PlanEntry.copy_back_lead``: TensorFlow's gates, torch's backward hooks); False where a compiler's
            scheduler places the transfers itself (XLA on JAX), and the planner then sets no leads.
    """

    output_gradient_activations: frozenset = frozenset()
    shape_only_layers: frozenset = layer_facts.STRUCTURAL_LAYERS
    fused_activation_reads_output_copy: bool = False
    recomputes_offloaded_calls: bool = False
    copy_back_allocated_at_trigger: bool = False
    concatenate_gradient_is_view: bool = False
    gradients_wait_between_readers: bool = False
    gradient_sum_allocated: bool = False
    weight_gradients_from_their_backward: bool = False
    plain_model_keeps_layer_outputs: bool = False
    shared_copy_stream: bool = False
    starts_copies_back_per_call: bool = True

    # ------------------------------------------------------- what the step's kernels move
    def eager_bytes(self, call, input_bytes: int, output_bytes: int):
        """The memory-bound bytes of ``call``'s forward and backward as this framework's kernels move them
        (``EagerBytes``), or None for the generic count of ``planning.call_costs`` (one read of each input and
        one write of each output per pass: what a fusing compiler such as XLA or grappler comes close to)."""
        return None

    # ------------------------------------------------------- what a gradient reads
    def output_gradient_activation(self, unit) -> str | None:
        """For a standalone activation layer whose gradient this framework computes from its output, its name."""
        name = layer_facts.standalone_activation(unit)
        return name if name in self.output_gradient_activations else None

    def fused_output_activation(self, unit) -> str | None:
        """For a Dense/Conv-family layer running Keras' own ``call`` with a fused activation whose gradient this
        framework computes from the output, the activation's name."""
        name = layer_facts.fused_activation(unit)
        return name if name in self.output_gradient_activations else None

    def keeps_no_activation(self, unit) -> bool:
        """The unit's gradient reads no tensor values (only shapes)."""
        return layer_facts.is_keras_class(unit, self.shape_only_layers) or layer_facts.is_linear_activation(unit)

    def backward_reads(self, unit) -> tuple:
        """``(reads_inputs, reads_output)`` of the unit's gradient as the framework differentiates it (plain).

        Shape-only layers read nothing; output-differentiated activation layers their output; max pooling and
        Dense/Conv-family layers with an output-differentiated fused activation both; anything else its inputs
        (the conservative choice).
        """
        if self.keeps_no_activation(unit):
            return False, False
        if self.output_gradient_activation(unit) is not None:
            return False, True
        if (layer_facts.is_keras_class(unit, layer_facts.MAX_POOLING_LAYERS)
                or self.fused_output_activation(unit) is not None):
            return True, True
        return True, False

    def reads_output_host_copy(self, unit) -> bool:
        """Whether the wrapped backward reads the call's output from its consumer's host copy (when one exists)
        instead of keeping it on the device."""
        if self.output_gradient_activation(unit) is not None:
            return True
        return self.fused_activation_reads_output_copy and self.fused_output_activation(unit) is not None

    def recomputes_offloaded_output(self, unit) -> bool:
        """Whether an offloaded call of ``unit`` recomputes its output in its backward (max pooling always)."""
        return self.recomputes_offloaded_calls or layer_facts.is_keras_class(unit, layer_facts.MAX_POOLING_LAYERS)

    # ------------------------------------------------ what a step holds besides
    def backward_temporaries(self, unit, recomputed: bool = False, lean: bool = False) -> int:
        """Input-sized temporaries the call's gradient holds besides the gradients of its inputs and outputs
        (``recomputed``: in keras-lms' recompute of an offloaded call; ``lean``: see ``lean_normalization_call``)."""
        if layer_facts.is_keras_class(unit, layer_facts.NORMALIZATION_LAYERS):
            return 0 if lean else layer_facts.NORMALIZATION_TEMPORARIES
        return 0

    def input_freed_before_input_gradient(self, call) -> bool:
        """Whether the call's backward is done with its inputs before their gradients exist (a compiler that
        computes a convolution's weight gradient first and frees the input), so the two never coexist."""
        return False

    def host_bytes(self, call, offloaded_bytes: int, batch_size: int = 1, lean_normalization: bool = True,
                   min_bytes: int = 0) -> int:
        """Bytes an offloaded call sends to host when its offloaded inputs are ``offloaded_bytes``: those inputs
        (TensorFlow and torch copy the tensors themselves); a back end that copies what its differentiation keeps
        instead says so (JAX: a ReLU's mask, a pooling's argmax indices; residuals under ``min_bytes`` stay)."""
        return offloaded_bytes

    def saved_extra_bytes(self, unit, input_bytes: int, output_bytes: int) -> int:
        """Bytes the framework saves for the call's backward besides its inputs and outputs."""
        return 0

    def lean_normalization_call(self, unit, input_dtypes) -> bool:
        """Whether the back end differentiates an offloaded call of ``unit`` from the forward's statistics
        (``LMSConfig.lean_normalization``) instead of recomputing it."""
        return False

    def lean_normalization_temporary_bytes(self, input_shape, input_dtype, batch_size: int = 1) -> int:
        """Bytes of that lean normalisation's temporaries for an input of ``input_shape``."""
        return 0

    def lean_convolution_call(self, unit) -> bool:
        """Whether the back end differentiates an offloaded call of ``unit`` without recomputing it."""
        return False

    def lean_convolution_bytes(self, unit) -> int:
        """What such a call's backward holds besides its input and the gradients (e.g. a kernel copy)."""
        return 0

    def update_temporary_bytes(self, model, optimizer=None) -> int:
        """Temporaries of the optimizer update besides weights, gradients and optimizer state."""
        return 0

    def static_extra_bytes(self, model, optimizer=None, default_slots: int = 2) -> int:
        """Device bytes held the whole step besides weights, gradients and optimizer state (layout copies)."""
        return 0

    def normalization_extra_bytes(self, call, input_sizes) -> int:
        """Bytes a whole normalization backward holds beyond ``NORMALIZATION_TEMPORARIES`` input-sized buffers
        (e.g. float32 arithmetic on float16 inputs)."""
        return 0

    def forward_temporaries(self, call, input_sizes, output_sizes, slab, released: int = 0) -> int:
        """Bytes a call holds only while its forward runs, besides its inputs and outputs. ``released``: the bytes
        of its inputs that its forward is the last to use (freed before its later temporaries are allocated)."""
        return 0

    def backward_layout_bytes(self, call, input_sizes, output_sizes) -> int:
        """Bytes a whole (not slab-computed) call's backward holds in other memory layouts: copies of its output
        gradient and input that a layout optimiser makes for the kernels."""
        return 0

    # ------------------------------------------------------------------ slabs
    def slab_plans(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        """Call index -> slab plan (``.count`` slabs) of the offloaded calls computed slab by slab (none here)."""
        return {}

    def elided_concatenations(self, calls, slabs: dict, batch_size: int) -> dict:
        """Index of a concatenation that is never built -> the slab call that reads its parts instead."""
        return {}

    def parked_inputs(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        """Call index -> positions of its inputs that go to host right after it, for a far later reader that reads
        them from there in windows (``PlanEntry.parked_inputs``; none here)."""
        return {}

    def slab_backward_bytes(self, call, input_sizes, output_sizes, slab) -> int:
        """Bytes a slab-computed call's backward holds (only called for calls in ``slab_plans``); ``input_sizes``
        are the input gradients it assembles: the parts of a concatenation it reads in parts
        (``elided_concatenations``), else its inputs."""
        raise NotImplementedError(f"{type(self).__name__} plans no slabs")

    def prefetched_slab_bytes(self, call, read_sizes, slab) -> int:
        """Bytes a slab-computed call's backward holds from the arrival of its prefetched copy back until it runs
        (``read_sizes``: the host copies its backward reads): the windows only the prefetch trigger gates."""
        return 0

    def slab_traffic(self, calls, index: int, slab, offloaded_row, batch_size: int):
        """A slab-computed call's host-link transfers (``planning.traffic.SlabTraffic``): the host copies it
        reads and the bytes its forward and backward bring back, halos and repeated passes included."""
        raise NotImplementedError(f"{type(self).__name__} plans no slabs")

    def slab_flop_factors(self, unit, slab) -> tuple:
        """``(forward, backward)`` multipliers of a slab-computed kernel call's FLOPs (its halos' recompute)."""
        return 1.0, 1.0

    def fused_slab_chains(self, calls, offloaded, slabs: dict, short=frozenset()) -> dict:
        """Call index -> (index of the call whose input copy it recomputes its input from, index of the call in
        between) for the slab calls whose input is recomputed instead of copied, and (source, None) for the
        activations among ``short`` (True: all) whose backward reads their source's input copy instead of their
        output's (short chains; none here)."""
        return {}

    def short_chain_bytes(self, source_call, source_input_bytes: int, slab) -> int:
        """Bytes a short chain's activation backward holds besides its slab backward: the source's outputs it
        recomputes on the source's input windows (``slab``: the source's slab plan)."""
        return 0

    def slab_sweeps(self, calls, offloaded, slabs: dict) -> list:
        """The runs of calls whose backward runs in passes over slab windows from the run's input (TensorFlow's
        ``offload.tensorflow.sweeps.Sweep``; none here)."""
        return []

    def pooling_folds(self, calls, offloaded, slabs: dict) -> dict:
        """Pooling call index -> ``(activation call index, stride)`` where the activation's slab backward takes
        the pooling's input gradient window by window and the pooling's backward returns none (TensorFlow's
        ``offload.tensorflow.pooling_folds``; none here). Callers drop the folds of swept calls."""
        return {}

    def slab_alignments(self, calls, offloaded, slabs: dict) -> dict:
        """Call index -> the row multiple its slab windows start on where the back end aligns them (TensorFlow:
        a folding activation and its BatchNorm on the pooling's stride, ``pooling_folds.alignments``; the
        step reads it from ``PlanEntry.slab_align``); none here."""
        return {}

    def room_for_keeps(self, calls, batch_size: int, device_budget) -> bool:
        """Whether the budget planner may keep offloaded calls on the device (its keep search): TensorFlow's
        grappler swaps by itself where kept calls push its own estimate of the step over the GPU's memory
        (``offload.tensorflow.grappler_estimate``); always here."""
        return True

    def forced_sweeps(self) -> bool:
        """Whether every candidate of ``slab_sweeps`` is swept whatever the profile (a test switch)."""
        return False

    def sweep_backward_bytes(self, calls, sweep, slabs: dict, input_sizes, output_sizes) -> dict:
        """Call index -> the device bytes its backward holds, for the calls of a sweep of ``slab_sweeps``
        (``input_sizes`` / ``output_sizes``: per call, as ``memory_model.tensor_sizes`` gives them)."""
        raise NotImplementedError(f"{type(self).__name__} plans no sweeps")

    def sweep_timing(self, calls, sweep, input_sizes) -> "SweepTiming":
        """When a sweep of ``slab_sweeps`` runs its passes, for the memory model's prefetch positions (none
        here: no effect)."""
        return SweepTiming()

    def sweep_traffic(self, calls, sweep, slabs: dict, offloaded, batch_size: int):
        """What a sweep of ``slab_sweeps`` reads and recomputes (TensorFlow's ``slab_costs.SweepTraffic``)."""
        raise NotImplementedError(f"{type(self).__name__} plans no sweeps")

    def recompute_sources(self, calls, offloaded, slabs: dict, chains: dict, batch_size: int) -> dict:
        """Tensor key -> ``planning.recompute.RecomputeSource`` for the tensors this back end can recompute in
        windows instead of copying (none here: no back end but TensorFlow's slabs reads windows)."""
        return {}
