"""Activation offload on the JAX back end (the back-end contract ``keras_lms.offload.Backend``, in JAX terms).

Keras' JAX trainer runs the training step under ``jax.jit``: what keras-lms builds is a traced program that XLA
compiles and schedules. Every offloaded layer call ``y = layer(x)`` becomes a ``jax.custom_vjp``
(`host_residuals.host_residual_call`): its forward rule runs the layer statelessly, moves each large residual
of its pullback to host memory (``jax.device_put(..., jax.memory.Space.Host)``, pinned host memory on a GPU), and
``jax.lax.optimization_barrier`` ties the copies to the call's output and their copies back to the incoming
cotangent, so XLA frees the device buffer between the forward and the backward use (without the barriers it
copies each residual out just before copying it back; ``docs/jax_findings.md``). No layer runs twice
(``lean_norm`` recomputes a BatchNorm's batch statistics).
BatchNorm statistics and SeedGenerator states are handed back from the stateless call, so Dropout masks and
moving statistics are the plain model's.

The modules: ``host_residuals`` (the offloaded call), ``lean`` (lean backward rules XLA needs), ``convolutions``
(a convolution over a concatenation's parts, a large one's forward in windows of rows), ``step`` (the step
context), ``tracing`` (the planning trace), ``devices`` (host device, memory readings), ``step_memory`` (the
planner's ``BackendFacts``) and ``deviceless`` (compile a step for an H100 without one and read its memory).

On a CPU, JAX lowers the copies to host to identities (and strips memory placement), so a CPU run tests the
numerics, not the offload: ``make test-jax-compile`` checks the offload in the compiled H100 program.
"""

from __future__ import annotations

from keras_lms.offload.common import no_training_call_scope as training_call_scope
from keras_lms.offload.common import offloadable_reason
from keras_lms.offload.jax.devices import (
    default_device,
    device_peak_bytes,
    executing_eagerly,
    reset_device_peak,
    validate_host_device,
)
from keras_lms.offload.jax.step import StepContext
from keras_lms.offload.jax.step_memory import memory_facts
from keras_lms.offload.jax.tracing import example_inputs, signature_of, spec_for, trace_calls


def resolve_jit_compile(jit_compile) -> bool:
    """Keras' JAX default: the step is jitted ("auto" and True), and the offload is built for what XLA compiles.
    False runs the step op by op (Keras' ``run_eagerly``-like JAX mode); ``jax.value_and_grad`` still traces the
    forward pass, so the offloaded calls are the same ``custom_vjp``."""
    if jit_compile not in ("auto", True, False):
        raise ValueError(f"jit_compile must be True, False or 'auto'; got {jit_compile!r}.")
    return jit_compile is not False


def input_gradient_from_output(unit):
    """None: an activation's gradient is what JAX's own rule makes of its residuals (no output-based path)."""
    return None


__all__ = [
    # the back-end contract (keras_lms.offload.Backend)
    "StepContext", "default_device", "device_peak_bytes", "example_inputs", "executing_eagerly",
    "input_gradient_from_output", "memory_facts", "offloadable_reason", "reset_device_peak", "resolve_jit_compile",
    "signature_of", "spec_for", "trace_calls", "training_call_scope", "validate_host_device",
]
