"""How a tensor goes to host and comes back on the torch back end (a package: one module per concern).

For every offloaded layer call ``y = layer(x)`` (the contract of ``keras_lms.offload.Backend``, in torch terms):

1. forward: a ``torch.autograd.Function`` runs the layer's *original* ``call`` through
   ``_keras_adapter.run_stateless`` (no autograd graph is built inside it). Its inputs are the call's tensors and
   the torch tensors behind the layer's trainable variables, so the weight gradients flow into ``.grad`` where
   Keras' torch trainer reads them. The new non-trainable values (BatchNorm moving statistics, seed-generator
   states) are assigned to the variables once, outside; the recompute uses a *snapshot* taken before.
2. swap-out: each offloaded input is copied into a pinned host buffer (from a pool keyed by shape, strides and dtype,
   reused across steps) on a dedicated CUDA copy stream (``non_blocking``); ``record_stream`` tells the caching
   allocator that the device tensor is in use by the copy, so it is released as soon as the copy has run and
   the forward pass drops it (the Function does not save it). One host copy per tensor per step: a U-Net skip
   tensor consumed by several offloaded calls is copied once (cache keyed by tensor identity, weakly).
3. backward: the host copies come back on the copy stream into device memory allocated on the compute stream
   (the copy stream first waits for the compute stream, so the block cannot still be in use); the backward of
   call k starts the swap-ins of the offloaded calls k-1 .. k-prefetch (forward order), so they overlap with
   call k's recompute. Before use, the compute stream waits on the copy's event. The layer is recomputed under
   ``torch.enable_grad()`` from the swapped-in inputs with the snapshot (identical Dropout masks and BatchNorm
   batch statistics) and the VJP is ``torch.autograd.grad``.
4. without the recompute:
   * relu/sigmoid/tanh activation layers (``ReLU()``, ``Activation(...)``) copy their *output* instead of
     their input (the same host copy as the next layer's input) and take their gradient from it with the very
     kernels torch's own autograd uses (``threshold_backward`` etc.), sharing the swap-in with the consumer
     (not elu: torch differentiates elu from its input, so an output-based gradient would differ by ~1e-7);
   * structural layers whose torch gradient reads no activation (Add, Concatenate, reshapes, padding,
     cropping, global average pooling) run plainly: autograd keeps nothing of them, so there is nothing to
     offload;
   * calls whose inputs and weights need no gradient run plainly (autograd keeps nothing of them either).
   Convolutions are recomputed (unlike the TF back end, torch has no graph pruning that would skip the
   forward convolution in the recompute). BatchNormalization calls with batch statistics are not (``lean_norm``,
   ``LMSConfig.lean_normalization``): the forward keeps Keras' batch mean and variance, and the backward is the
   batch-norm gradient from them, evaluated slab by slab without input-sized float32 temporaries. Conv2D/Conv3D
   calls with a linear activation are not either (``lean_conv``): ``aten.convolution_backward`` on the
   swapped-in input, bit-identical to autograd.

Each wrapped model owns its offloader state (``offloader.Offloader``, ``offloader_of(wrapped)``): its host buffer
pool, its transfer counters and its settings, so two wrapped models in one process (a GAN's generator and
discriminator, models trained alternately) neither evict each other's pooled buffers nor count each other's bytes.
Only the copy streams, one per device, are shared; ``transfer_stats()`` is the total of every model.

On a machine without CUDA nothing is copied: the "host copy" is the tensor itself (``CPU_HOST_COPIES = True``
makes it a real copy into pool buffers, which the tests use). The recompute, its numerics and the scheduling
are the same, so CPU CI tests the logic.

Keras keeps every intermediate tensor of a functional graph alive until the forward pass returns; on an eager
back end that would keep all activations on the device, so :meth:`StepContext.forward_scope` makes the
wrapped model's functional graphs release each tensor after its last consumer
(``_keras_adapter.releasing_graph_runs``). Keras' torch tree utilities keep every tensor they flatten in a
reference cycle until Python's cyclic collector runs; the forward pass and each recompute run under
``_keras_adapter.acyclic_torch_trees``, so an offloaded original dies when its last forward consumer is done
(also with ``gc.disable()``; ``tests/offload/torch/test_memory.py``).

The modules: ``stats`` (transfer counters), ``pool`` (host buffer pool), ``offloader`` (a model's pool, counters
and settings), ``transfer`` (copy streams, host copies, swap-ins, back-pressure), ``rng`` (RNG states for the
recompute), ``function`` (the autograd Function and the per-call record), ``no_recompute`` (output-based gradients,
plain structural layers), ``lean_norm`` (BatchNorm's backward from the forward's statistics), ``lean_conv`` (a
convolution's backward without recompute), ``step`` (the step context and swap-in scheduling), ``tracing`` (the
planning trace), ``devices`` (host device, memory readings) and ``step_memory`` (the planner's ``BackendFacts``
for this back end).
This package re-exports what the rest of keras-lms, the tests and the benchmarks use, and holds the default
settings ``CPU_HOST_COPIES`` and ``MAX_INFLIGHT_BYTES``: a model's step reads them from here when it starts, unless
the model was given its own (``offloader_of(wrapped).cpu_host_copies`` / ``.max_inflight_bytes``).
"""

from __future__ import annotations

from keras_lms.offload.common import no_training_call_scope as training_call_scope
from keras_lms.offload.common import offloadable_reason
from keras_lms.offload.common import without_xla as resolve_jit_compile
from keras_lms.offload.torch.devices import (
    default_device,
    device_peak_bytes,
    executing_eagerly,
    reset_device_peak,
    validate_host_device,
)
from keras_lms.offload.torch.function import _CallRecord, _OffloadedFunction
from keras_lms.offload.torch.no_recompute import input_gradient_from_output, runs_plainly
from keras_lms.offload.torch.offloader import Offloader, offloader_of
from keras_lms.offload.torch.pool import HostBufferPool, clear_host_pool, host_pool
from keras_lms.offload.torch.rng import _RngState
from keras_lms.offload.torch.stats import TransferCounter, TransferStats, reset_transfer_stats, transfer_stats
from keras_lms.offload.torch.step import StepContext, swap_in_order
from keras_lms.offload.torch.step_memory import memory_facts
from keras_lms.offload.torch.tracing import example_inputs, signature_of, spec_for, trace_calls
from keras_lms.offload.torch.transfer import Transfer, _HostCopy, _SwapIn

# The defaults of every wrapped model's settings (Offloader), read when one of its steps starts.
# On a machine without CUDA, copy offloaded tensors into pool buffers instead of keeping them (tests).
CPU_HOST_COPIES = False

# Device bytes that device-to-host copies still being read may hold (at least two tensors' worth, so the copy
# engine always has the next copy queued).
MAX_INFLIGHT_BYTES = 256 << 20

__all__ = [
    "CPU_HOST_COPIES", "MAX_INFLIGHT_BYTES",
    # the back-end contract (keras_lms.offload.Backend)
    "StepContext", "default_device", "device_peak_bytes", "example_inputs", "executing_eagerly",
    "input_gradient_from_output", "memory_facts", "offloadable_reason", "reset_device_peak", "resolve_jit_compile",
    "signature_of", "spec_for", "trace_calls", "training_call_scope", "validate_host_device",
    # the machinery (tests and benchmarks)
    "HostBufferPool", "Offloader", "Transfer", "TransferCounter", "TransferStats", "clear_host_pool", "host_pool",
    "offloader_of", "reset_transfer_stats", "runs_plainly", "swap_in_order", "transfer_stats",
    "_CallRecord", "_HostCopy", "_OffloadedFunction", "_RngState", "_SwapIn",
]
