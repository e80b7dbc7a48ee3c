"""How a tensor goes to host and comes back on the TensorFlow back end: the step context and its per-call record.

For every offloaded layer call ``y = layer(x)`` (docs/design.md, "One training step"):

1. forward: ``y`` is computed by the layer's original ``call`` under a StatelessScope, inside a
   ``tf.custom_gradient`` function whose inputs are ``x`` and the layer's trainable values; the new
   non-trainable values (BatchNorm moving statistics, Dropout seed state) are assigned once, outside;
2. swap-out: a host op (``record.host_op``) under ``tf.device(host)``, once per tensor per step, shared by all
   consumers;
3. backward: the host copy is brought back by a host op that carries a control dependency on a gradient of the
   backward pass (this call's own gradient, or with ``prefetch=N`` the gradient of the call N calls later), so
   it cannot be sent during the forward pass; the layer is recomputed from the swapped-in inputs with the
   *snapshot* of its non-trainable values, and the VJP is taken under a local tape. TensorFlow prunes
   recompute ops that no gradient needs.
4. fused activations: for Dense/Conv-family layers whose activation's derivative is a function of its output
   (relu, sigmoid, tanh, elu), the gradient of the activation is taken from the layer's *output*, which is
   the next layer's offloaded input; the layer is then recomputed without its activation, so the forward
   convolution itself is never recomputed (only its input/filter gradients are computed).

The forward tensors the backward pass reads are then the host copies and small tensors only.

The modules: ``step`` (the step context), ``record`` (what it keeps of one call, and the host op),
``recompute_scopes`` (BatchNorm statistics and fused activations in the recompute), ``output_gradients`` (the
output-based gradient kernels; ``StepContext`` looks them up there, and tests replace them there to count their
uses), ``slabs`` and ``slab_plan`` (slab-wise forward and backward, and where a call is cut), ``tracing`` (the
planning trace), ``devices`` (host device, allocator statistics), ``call_options`` (grappler's own swaps kept out of the
wrapped step) and ``step_memory`` (the planner's
``BackendFacts`` for this back end). This package re-exports the back-end contract (``keras_lms.offload.Backend``).
"""


from keras_lms.offload.common import offloadable_reason
from keras_lms.offload.common import without_xla as resolve_jit_compile
from keras_lms.offload.tensorflow.call_options import without_grappler_swaps as training_call_scope
from keras_lms.offload.tensorflow.devices import (
    default_device,
    device_peak_bytes,
    executing_eagerly,
    reset_device_peak,
    validate_host_device,
)
from keras_lms.offload.tensorflow.output_gradients import (
    fused_activation_grad,
    input_gradient_from_output,
    reads_own_output,
)
from keras_lms.offload.tensorflow.step import StepContext
from keras_lms.offload.tensorflow.step_memory import memory_facts
from keras_lms.offload.tensorflow.tracing import example_inputs, signature_of, spec_for, trace_calls

__all__ = ["StepContext", "default_device", "device_peak_bytes", "example_inputs", "executing_eagerly",
           "fused_activation_grad", "input_gradient_from_output", "memory_facts", "offloadable_reason",
           "reads_own_output", "reset_device_peak", "resolve_jit_compile", "signature_of", "spec_for", "trace_calls",
           "training_call_scope", "validate_host_device"]
