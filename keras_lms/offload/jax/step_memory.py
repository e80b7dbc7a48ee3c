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

from keras_lms.offload.jax import convolutions, parking, row_windows
from keras_lms.offload.jax.lean import block_max_pool
from keras_lms.offload.jax.lean_norm import lean_layer
from keras_lms.planning import BackendFacts, layer_facts
from keras_lms.planning.plan import tensor_bytes

# Calls between a tensor's first reader and a concatenation of it beyond which the tensor is parked on host.
PARK_DISTANCE = 2


def windowed_convolution(unit, input_shape, input_bytes: int, slab_bytes: int) -> bool:
    """``convolutions.window_count`` > 1 for a call of ``unit`` on inputs of ``input_bytes`` in all."""
    return (convolutions.WINDOWED and convolutions.SPLIT_PARTS and convolutions.windowable(unit)
            and len(input_shape) >= 3 and input_shape[1] is not None
            and row_windows.window_count(input_bytes, input_shape[1], slab_bytes) > 1)


class JaxFacts(BackendFacts):
    """The JAX back end's memory facts (see the module docstring)."""

    recomputes_offloaded_calls = False
    plain_model_keeps_layer_outputs = False

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

    def parked_inputs(self, calls, offloaded, batch_size: int, slab_bytes: int) -> dict:
        """The parts of a channel concatenation read by an offloaded convolution in windows (``convolutions``:
        its parts' bytes over ``slab_bytes``), parked on host after their first reader when that is more than
        ``PARK_DISTANCE`` calls before the concatenation (a U-Net skip: ``step``)."""
        if not (slab_bytes and parking.PARKED):
            return {}
        first, readers = {}, {}
        for i, call in enumerate(calls):
            for j, key in enumerate(call.keys):
                first.setdefault(key, (i, j))
                readers.setdefault(key, []).append(i)
        parked = {}
        for c, call in enumerate(calls):
            if not (layer_facts.is_keras_class(call.unit, {"Concatenate"}) and len(call.output_keys) == 1
                    and len(call.keys) > 1):
                continue
            reader = readers.get(call.output_keys[0], [])
            if len(reader) != 1 or not any(offloaded[reader[0]]):
                continue
            sizes = [tensor_bytes(s, d, batch_size) for s, d in zip(call.shapes, call.dtypes)]
            if not windowed_convolution(calls[reader[0]].unit, call.shapes[0], sum(sizes), slab_bytes):
                continue
            for key in call.keys:
                i, j = first[key]
                if i + PARK_DISTANCE < c:
                    parked.setdefault(i, set()).add(j)
        return {i: sorted(j) for i, j in parked.items()}

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
