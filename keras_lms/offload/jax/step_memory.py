"""How a JAX training step holds device memory: the planner's ``BackendFacts`` for this back end.

Calibrated against the programs XLA compiles for an H100 (``benchmarks/jax_compiled_memory.py --variants
plain,wrap``: the report's predicted peak set beside device temp + arguments, docs/benchmarks.md):

* an offloaded call is not recomputed: its backward reads the forward's own residuals, brought back from host;
* XLA frees every buffer after its last use, so the plain model keeps no layer output past its last reader;
* XLA fuses BatchNormalization's backward (its element-wise parts into the reductions that need them), so it
  holds no input-sized temporaries besides the gradients; with the generic three, the report over-predicted
  the plain 3D U-Net 96^3 by 51% and the wrapped 2D U-Net by 34%;
* each offloaded call copies its own residuals (a ReLU's input, the next convolution's input: two host copies),
  so no activation counts as differentiated from its output. Counting ReLU that way would bring the plain
  predictions to 1.03-1.10x, but the wrapped plan's host bytes would then miss the ReLUs' copies (109 of 154 MB
  on the 64^3 U-Net of tests/offload/jax/test_compiled_offload.py).
* what an offloaded call copies is what its differentiation keeps (``host_bytes``): a ReLU's mask (one byte per
  element), a block max pooling's argmax indices (one byte per output element, ``lean``), a BatchNormalization's
  input (``lean_norm``; JAX's own differentiation keeps two input-sized float32 residuals), each only when it
  is at least ``min_bytes``. Before this the plan counted every call's inputs and matched the compiled host
  temporaries within 1% only because BatchNorm's second residual made up for the masks and indices.

* XLA runs 2D convolutions channels-last and frees a convolution's input before its input gradient is
  allocated (``channels_last_native_convolution``); without that the 2D U-Net 8x256^2 was predicted at 1.17x.

With these the report's wrapped peaks are 0.97-1.00x the compiled programs' device temp + arguments, its plain
peaks 1.24-1.41x (XLA keeps less of a plain step than the generic facts say), and the plan's host bytes are the
compiled program's host temporaries within 1%.
"""

from __future__ import annotations

from keras_lms.offload.jax import window_facts
from keras_lms.offload.jax.lean import block_max_pool
from keras_lms.offload.jax.lean_norm import lean_layer
from keras_lms.planning import BackendFacts, layer_facts
from keras_lms.planning.plan import tensor_bytes


class JaxFacts(BackendFacts):
    """The JAX back end's memory facts (see the module docstring)."""

    recomputes_offloaded_calls = False
    plain_model_keeps_layer_outputs = False
    starts_copies_back_per_call = False  # XLA's scheduler places the host transfers (docs/jax_findings.md)

    def host_bytes(self, call, offloaded_bytes: int, batch_size: int = 1, lean_normalization: bool = True,
                   min_bytes: int = 0) -> int:
        unit, elements = call.unit, offloaded_bytes // max(1, tensor_bytes((), call.dtypes[0]))
        if layer_facts.standalone_activation(unit) == "relu":
            sent = elements  # the mask (bool)
        elif len(call.shapes) == 1 and block_max_pool(unit, call.shapes[0]) and call.output_shapes:
            sent = tensor_bytes(call.output_shapes[0], "uint8", batch_size)  # the argmax index per window (lean)
        elif layer_facts.is_keras_class(unit, {"BatchNormalization"}):
            lean = lean_normalization and lean_layer(unit, call.dtypes[0])
            sent = offloaded_bytes if lean else 2 * elements * 4  # (the input; else two float32 residuals)
        else:
            return offloaded_bytes
        return sent if sent >= min_bytes else 0

    # ------------------------------------------------------------------ windows of rows (``window_facts``)
    def slab_plans(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        return window_facts.window_plans(calls, offloaded, batch_size, slab_bytes)

    def elided_concatenations(self, calls, slabs: dict, batch_size: int) -> dict:
        return window_facts.elided_concatenations(calls, slabs, batch_size)

    def slab_backward_bytes(self, call, input_sizes, output_sizes, slab) -> int:
        return window_facts.window_backward_bytes(call, input_sizes, output_sizes, slab)

    def forward_temporaries(self, call, input_sizes, output_sizes, slab, released: int = 0) -> int:
        return 0 if slab is None else window_facts.window_forward_bytes(call, input_sizes, output_sizes, slab)

    def slab_traffic(self, calls, index: int, slab, offloaded_row, batch_size: int):
        return window_facts.window_traffic(calls, index, slab, offloaded_row, batch_size)

    def parked_inputs(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        return window_facts.parked_inputs(calls, offloaded, batch_size, slab_bytes)

    def input_freed_before_input_gradient(self, call) -> bool:
        return channels_last_native_convolution(call)

    def backward_temporaries(self, unit, recomputed: bool = False, lean: bool = False) -> int:
        if layer_facts.is_keras_class(unit, layer_facts.NORMALIZATION_LAYERS):
            return 0  # fused by XLA (module docstring)
        return super().backward_temporaries(unit, recomputed, lean)


def channels_last_native_convolution(call) -> bool:
    """A Keras 2D convolution, which XLA runs channels-last on an H100 (``b01f`` in the compiled HLO, no layout
    transposes of its activations). XLA then computes the weight gradient first and frees the input before the
    input gradient is allocated: the compiled 2D U-Net 8x256^2's peak, the first decoder convolution's backward,
    holds the gradients of its output and input, not its input too. 3D convolutions run channels-first
    (``bf012``, in float32 and in float16 alike), their activations transposed around them as grappler does on
    TensorFlow, and hold all three."""
    unit = call.unit
    if not layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS) or not call.shapes:
        return False
    return getattr(unit, "data_format", "channels_last") == "channels_last" and len(call.shapes[0]) == 4


FACTS = JaxFacts()


def memory_facts() -> JaxFacts:
    """The JAX back end's ``BackendFacts`` (the back-end contract's ``memory_facts``)."""
    return FACTS
