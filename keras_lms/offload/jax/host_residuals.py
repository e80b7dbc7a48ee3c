"""Run a Keras layer's call on the JAX back end with what its backward needs kept in host memory.

The mechanism (measured in the program XLA compiles for an H100, ``docs/jax_findings.md``):

- The layer's call runs statelessly (its variables' current values passed in explicitly, the updated
  non-trainable values — BatchNorm statistics, SeedGenerator state — handed back) under a ``jax.custom_vjp``.
- Its forward rule takes ``jax.vjp`` of that stateless call and moves every large residual of the pullback
  (what JAX keeps for the backward: a convolution's input, a ReLU's output, BatchNorm's normalised input...) to
  host memory with ``jax.device_put(..., jax.memory.Space.Host)``.
- ``jax.lax.optimization_barrier`` ties the host copies to the layer's output: whatever consumes the output
  (the next layer) waits for the copies to finish, so XLA cannot schedule a copy to host late, and the device
  buffer can be freed as soon as the forward pass no longer reads it.
- The backward rule ties the host residuals to the incoming cotangent with a second barrier before copying
  them back, so XLA cannot hoist the copy back into the forward pass either; then it applies the pullback.

The naive alternative, ``jax.checkpoint`` with ``save_and_offload_only_these_names`` around each layer
(`checkpoint_offload_call`, kept as the negative control), leaves the copy to host unordered: XLA's scheduler
places it just before its copy back, and the device buffer lives through the whole forward pass.

No layer runs twice: the backward uses the forward's own residuals, brought back from host. Both functions are
meant to run as a layer's ``call`` (inside ``Layer.__call__``, so Keras has resolved ``training``, masks and
the autocast scope), with ``original`` the layer's own ``call``; `keras_lms._keras_adapter.patched_calls`
installs such a stand-in.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from keras import StatelessScope

from keras_lms import _keras_adapter as adapter
from keras_lms.offload.jax import row_windows
from keras_lms.offload.jax.lean import lean_pullback_for

__all__ = ["OFFLOAD_NAME", "checkpoint_offload_call", "checkpoint_offloading", "host_residual_call",
           "host_residuals", "stateless_pure_call"]

OFFLOAD_NAME = "keras_lms_offload"
DEFAULT_MIN_BYTES = 256 << 10
BARRIERS = frozenset({"forward", "backward", "gradients"})
STREAMED = True  # False: host residuals come back whole even for a windowed rule (the compiled tests' control)
WINDOWED_COPIES = True  # False: large residuals go to host whole (the control)


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def stateless_pure_call(layer, original: Callable, args: tuple, kwargs: dict):
    """The layer's call as a pure function of its variables' values and its array arguments.

    Returns:
        ``(fn, trainable, non_trainable, arrays, assign_back)``: ``fn(trainable, non_trainable, arrays)`` returns
        ``((outputs, losses), new_non_trainable)``; ``losses`` are what the call passed to ``add_loss`` (a
        regulariser computed inside ``call``: an output of the pure function, so its gradient flows back);
        ``trainable``/``non_trainable`` are the variables' current values and ``arrays`` the array leaves of
        ``(args, kwargs)`` (the rest — ``training``, ``None`` — stays fixed); ``assign_back(new_non_trainable,
        losses)`` writes the updated state into the enclosing stateless scope and adds the losses to the layer,
        as ``Layer.stateless_call``'s caller would.
    """
    trainable_vars = list(layer.trainable_variables)
    non_trainable_vars = list(layer.non_trainable_variables)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    array_at = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def fn(trainable, non_trainable, arrays):
        filled = list(leaves)
        for i, value in zip(array_at, arrays):
            filled[i] = value
        call_args, call_kwargs = jax.tree.unflatten(treedef, filled)
        mapping = list(zip(trainable_vars, trainable)) + list(zip(non_trainable_vars, non_trainable))
        with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            outputs = original(*call_args, **call_kwargs)
        return (outputs, list(scope.losses)), [scope.get_current_value(v) for v in non_trainable_vars]

    def assign_back(new_non_trainable, losses=()):
        for variable, value in zip(non_trainable_vars, new_non_trainable):
            variable.assign(value)
        for loss in losses:
            layer.add_loss(loss)

    # the step's traced values (the enclosing stateless scope's), in their storage dtype: no autocast
    return (fn, adapter.raw_values(trainable_vars), adapter.raw_values(non_trainable_vars),
            [leaves[i] for i in array_at], assign_back)


def _zero_cotangent(value):
    """A zero cotangent for a primal ``value`` (``float0`` for integer state such as a seed)."""
    if jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.zeros_like(value)
    return np.zeros(value.shape, dtype=jax.dtypes.float0)


_RECOMPUTED = frozenset({"broadcast_in_dim", "iota", "full", "zeros_like", "convert_element_type"})


def _save_all_but_constants(prim, *_, **__) -> bool:
    """``jax.checkpoint`` policy of the pullback: save every intermediate except tensors built from constants.

    ``jax.vjp`` would keep e.g. the full-size zeros of a ReLU's derivative as a residual; XLA then shares one such
    buffer between every ReLU of that shape and keeps it from the first forward use to the last backward one.
    Recomputed in the backward, it fuses into its consumer and takes no memory.
    """
    return prim.name not in _RECOMPUTED


def _copy_windows(value, slab_bytes: int) -> int:
    """In how many windows of rows a residual is copied to host (``row_windows.host_copy``): its bytes over
    ``slab_bytes`` (1: whole)."""
    if not WINDOWED_COPIES or value.ndim < 3:
        return 1
    return row_windows.window_count(row_windows.nbytes(value), value.shape[1], slab_bytes)


def _nbytes(value) -> int:
    return int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize


def host_residual_call(layer, original: Callable, *args: Any, min_bytes: int = DEFAULT_MIN_BYTES,
                       record: list | None = None, barriers: frozenset = BARRIERS, lean: bool = True,
                       recompute_constants: bool = True, forward_call: Callable | None = None,
                       lean_normalization: bool = True, slab_bytes: int = 0, pullback_maker: Callable | None = None,
                       **kwargs: Any):
    """Run ``original(*args, **kwargs)`` (the layer's call) with its large backward residuals in host memory.

    Args:
        layer: the Keras layer whose call this is (its variables are read from the enclosing stateless scope,
            and its updated non-trainable variables assigned back to it).
        original: the layer's own ``call``.
        *args, **kwargs: the call's arguments.
        min_bytes: residuals smaller than this stay on the device (the layer's weights always do).
        record: when given, ``(layer.name, bytes)`` of each residual sent to host is appended to it (at trace).
        lean_normalization: a BatchNormalization with batch statistics keeps only its input and scale for its
            backward (``lean_norm``; ``LMSConfig.lean_normalization``).
        slab_bytes: a lean backward whose operands exceed this runs over windows of rows (``row_windows``;
            ``LMSConfig.slab_bytes``; 0: whole).
        forward_call: computes the same outputs (and state) as ``original`` from the same arguments in another way
            (a convolution in windows of rows: ``convolutions``); it runs the forward pass, and the backward is
            ``original``'s pullback (its residuals, its gradients), its lean rule's (``lean``) or ``pullback_maker``'s.
        pullback_maker: makes this call's pullback (``convolution_backward.windowed_pullback``), in place of
            ``jax.vjp``'s or a lean rule's: ``pullback_maker(trainable, arrays)`` returns a ``jax.tree_util.Partial``
            whose leaves are the residuals and which maps the outputs' cotangent to ``(trainable_grads,
            array_grads)``. A maker (or lean rule) with ``streams_host_rows`` set reads its host residuals a window
            of rows at a time (``row_windows.over_rows``): they are handed to it in host memory.
        barriers, lean, recompute_constants: the parts of the mechanism, all on by default; switched off one by
            one only to measure what each does (``docs/jax_findings.md``). ``barriers`` holds any of
            ``"forward"`` (copies to host before the output is used), ``"backward"`` (residuals wait for the
            output cotangent) and ``"gradients"`` (the input gradient waits for the weight gradients).

    Returns:
        The call's outputs. Under ``jax.grad`` the pullback's residuals of at least ``min_bytes`` live in host
        memory (``pinned_host``) between the forward and the backward use.
    """
    fn, trainable, non_trainable, arrays, assign_back = stateless_pure_call(layer, original, args, kwargs)
    run = fn if forward_call is None else stateless_pure_call(layer, forward_call, args, kwargs)[0]
    layout = {}  # filled while the forward rule is traced: the pullback's structure and which leaves went to host

    @jax.custom_vjp
    def call(trainable, non_trainable, arrays):
        return run(trainable, non_trainable, arrays)

    if pullback_maker is not None:
        lean = pullback_maker
    else:
        lean = lean_pullback_for(layer, trainable, arrays, kwargs, lean_normalization, slab_bytes) if lean else None
    policy = _save_all_but_constants if recompute_constants else jax.checkpoint_policies.everything_saveable
    streams = STREAMED and getattr(lean, "streams_host_rows", False)

    def forward(trainable, non_trainable, arrays):
        if lean is not None:  # (layers whose call adds no loss: their pullback takes the outputs' cotangent)
            pullback = lean(trainable, arrays)
            if forward_call is None:
                outputs, new_non_trainable = fn(trainable, non_trainable, arrays)
        else:
            outputs, pullback, new_non_trainable = jax.vjp(
                jax.checkpoint(lambda t, a: fn(t, non_trainable, a), policy=policy),
                trainable, arrays, has_aux=True)
        residuals, treedef = jax.tree.flatten(pullback)
        weights = {id(w) for w in jax.tree.leaves(trainable)}
        offloaded, seen = [], set()
        for i, leaf in enumerate(residuals):
            # (a residual already in host memory, a parked input, stays there as it is)
            if (_nbytes(leaf) >= min_bytes and id(leaf) not in weights and id(leaf) not in seen
                    and not row_windows.on_host(leaf)):
                offloaded.append(i)
                seen.add(id(leaf))
        on_host = [row_windows.host_copy(residuals[i], _copy_windows(residuals[i], slab_bytes)) for i in offloaded]
        if forward_call is not None:
            # The outputs computed another way (the pullback's own forward is then unread, and XLA removes it),
            # after the copies to host: their layout conversions are made and freed before it runs.
            on_host, arrays = jax.lax.optimization_barrier((on_host, arrays))
            outputs, new_non_trainable = run(trainable, non_trainable, arrays)
        # The consumer of `outputs` waits for the copies to host: they cannot be scheduled late.
        if "forward" in barriers:
            on_host, outputs = jax.lax.optimization_barrier((on_host, outputs))
        kept = list(residuals)
        for i, value in zip(offloaded, on_host):
            kept[i] = value
        layout.update(treedef=treedef, offloaded=offloaded)
        if record is not None:
            record.extend((layer.name, _nbytes(residuals[i])) for i in offloaded)
        return (outputs, new_non_trainable), (kept, non_trainable)

    def backward(saved, cotangents):
        kept, non_trainable = saved
        output_cotangent, _ = cotangents
        # Every residual waits for the backward to reach this layer: the copies back cannot be hoisted into the
        # forward, and what stayed on the device (the weights) is a new value here, so XLA re-derives its
        # backward layouts instead of keeping the forward's transposed copies alive in between.
        if "backward" in barriers:
            kept, output_cotangent = jax.lax.optimization_barrier((kept, output_cotangent))
        residuals = list(kept)
        if not streams:  # (a streaming rule copies back a window of rows at a time itself: row_windows)
            for i in layout["offloaded"]:
                residuals[i] = jax.device_put(kept[i], jax.memory.Space.Device)
        pullback = jax.tree.unflatten(layout["treedef"], residuals)
        trainable_grads, array_grads = pullback(output_cotangent[0] if lean is not None else output_cotangent)
        # The input gradient (what the previous layer's backward waits for) is released only with the weight
        # gradients: XLA cannot run the input-gradient chain ahead and leave each weight gradient, with its
        # residual copied back and its cotangent, waiting until the optimizer update.
        if "gradients" in barriers:
            trainable_grads, array_grads = jax.lax.optimization_barrier((trainable_grads, array_grads))
        return trainable_grads, jax.tree.map(_zero_cotangent, non_trainable), array_grads

    call.defvjp(forward, backward)
    (outputs, losses), new_non_trainable = call(trainable, non_trainable, arrays)
    assign_back(new_non_trainable, losses)
    return outputs


def offload_policy(names=(OFFLOAD_NAME,)):
    """``jax.checkpoint`` policy: recompute everything except the named values, which go to ``pinned_host``."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


def checkpoint_offload_call(layer, original: Callable, *args: Any, min_bytes: int = DEFAULT_MIN_BYTES,
                            **kwargs: Any):
    """The naive per-layer offload (the negative control of ``tests/offload/jax``): ``original`` under
    ``jax.checkpoint`` with `offload_policy`, its large array inputs named for offload, the rest recomputed.

    Numerically it equals the plain call; on the compiled H100 program XLA schedules each copy to host just
    before its copy back, so device memory does not go down (``docs/jax_findings.md``).
    """
    fn, trainable, non_trainable, arrays, assign_back = stateless_pure_call(layer, original, args, kwargs)

    def named(trainable, non_trainable, arrays):
        arrays = [jax.ad_checkpoint.checkpoint_name(a, OFFLOAD_NAME) if _nbytes(a) >= min_bytes else a
                  for a in arrays]
        return fn(trainable, non_trainable, arrays)

    (outputs, losses), new_non_trainable = jax.checkpoint(named, policy=offload_policy())(
        trainable, non_trainable, arrays)
    assign_back(new_non_trainable, losses)
    return outputs


@contextlib.contextmanager
def host_residuals(layers: Iterable, min_bytes: int = DEFAULT_MIN_BYTES, record: list | None = None, **options):
    """While active, every call of each of ``layers`` runs through `host_residual_call` (``options``: its
    ``barriers``, ``lean``, ``recompute_constants``).

    Trace (``jax.jit(...).lower`` or the first call of a jitted step) inside the block; the compiled program keeps
    the offload.
    """
    def make(layer, original):
        return functools.partial(host_residual_call, layer, original, min_bytes=min_bytes, record=record, **options)

    with adapter.patched_calls(list(layers), make):
        yield


@contextlib.contextmanager
def checkpoint_offloading(layers: Iterable, min_bytes: int = DEFAULT_MIN_BYTES):
    """While active, every call of each of ``layers`` runs through `checkpoint_offload_call` (the naive control)."""
    def make(layer, original):
        return functools.partial(checkpoint_offload_call, layer, original, min_bytes=min_bytes)

    with adapter.patched_calls(list(layers), make):
        yield
