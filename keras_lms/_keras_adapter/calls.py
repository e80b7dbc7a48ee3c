"""Call context and call interception: see each layer call after Keras resolved it, and replay its context.

Keras internals relied on (Keras 3.15), and why:

* ``Layer.__call__`` / ``Operation.__call__`` look ``call`` up on the *instance*: shadowing the bound method in
  the instance dict (:func:`patched_calls`) intercepts every call of that op *after* Keras resolved
  ``training``, masks and the autocast scope, and leaves the class untouched;
* ``keras.src.layers.layer.CallContext`` and the ``global_state`` attribute ``"current_call_ctx"`` that
  ``Layer._get_call_context`` reads: ``training`` (and every argument registered with
  ``Layer._register_call_context_args``) reaches sublayers called inside ``call`` only through this
  thread-local context. The backward recompute runs ``call`` outside ``Layer.__call__`` (and on another thread
  on torch), so :class:`CallInContext` records the context's values when the call is intercepted and replays
  them; a context whose ``entry_layer`` is None is neither reset nor has its losses cleared by a sublayer
  (``Layer._maybe_reset_call_context``).
"""

from __future__ import annotations

import contextlib

from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext


def original_call(op):
    """The bound ``call`` that ``Operation.__call__`` would run for ``op`` (ignoring our patch)."""
    own = op.__dict__.get("_keras_lms_original_call")
    if own is not None:
        return own
    return op.call


_CALL_CONTEXT = "current_call_ctx"  # the global_state attribute Layer._get_call_context reads


def _context_values(context) -> dict | None:
    """The call-context arguments a ``CallContext`` holds (``training`` and any registered with
    ``Layer._register_call_context_args``), or None for no context."""
    if context is None:
        return None
    return {name: value for name, value in vars(context).items() if name != "entry_layer"}


def _holds(context, values) -> bool:
    """Whether ``context`` is a live context holding exactly ``values`` (compared by identity: they may be tensors)."""
    current = _context_values(context)
    if current is None or values is None:
        return current is values
    return current.keys() == values.keys() and all(current[k] is values[k] for k in values)


@contextlib.contextmanager
def _entered_call_context(values):
    """Make a fresh ``CallContext`` holding ``values`` the current one (None: no context), restoring on exit.

    Its ``entry_layer`` is None, so no sublayer resets it (``Layer._maybe_reset_call_context``) or clears its
    losses as a new entry layer would; what the sublayers write into it is dropped on exit.
    """
    previous = global_state.get_global_attribute(_CALL_CONTEXT)
    context = None
    if values is not None:
        context = CallContext(entry_layer=None)
        for name, value in values.items():
            context.set_value(name, value)
    global_state.set_global_attribute(_CALL_CONTEXT, context)
    try:
        yield
    finally:
        global_state.set_global_attribute(_CALL_CONTEXT, previous)


class CallInContext:
    """An op's original ``call``, bound to the Keras call context of one intercepted call.

    ``Layer.__call__`` resolves ``training`` (explicit argument, else the enclosing call's context, else the
    signature default) and stores it in a thread-local ``CallContext`` that every sublayer called inside
    ``call`` reads. A composite layer whose ``call`` takes no ``training`` argument therefore gets the flag to
    its inner Dropout/BatchNorm only through that context. The backward recompute runs ``call`` outside
    ``Layer.__call__`` (no context, so inference mode) and on another thread on torch; this records the
    context's values when the call is intercepted and replays them.

    Called inside the very context it recorded, still holding the recorded values (the forward pass), it runs
    there, so what its sublayers write into the context reaches later calls exactly as in the plain model.
    Anywhere else (the recompute, or a retried forward whose first attempt changed the context) it runs
    under a fresh context holding the recorded values.
    """

    __slots__ = ("call", "context", "values")

    def __init__(self, call):
        self.call = call
        self.context = global_state.get_global_attribute(_CALL_CONTEXT)
        self.values = _context_values(self.context)

    def __call__(self, *args, **kwargs):
        current = global_state.get_global_attribute(_CALL_CONTEXT)
        if current is self.context and _holds(current, self.values):
            return self.call(*args, **kwargs)
        with _entered_call_context(self.values):
            return self.call(*args, **kwargs)


def _intercepting_call(op, original, make_wrapper):
    """The instance ``call`` that hands each call to ``make_wrapper(op, CallInContext(original))``."""

    def intercepted(*args, **kwargs):
        return make_wrapper(op, CallInContext(original))(*args, **kwargs)

    return intercepted


@contextlib.contextmanager
def patched_calls(ops, make_wrapper):
    """Shadow ``op.call`` with ``make_wrapper(op, original)`` for every op, restoring on exit.

    ``Layer.__call__`` / ``Operation.__call__`` look ``call`` up on the instance, so an instance attribute
    intercepts every call of that op after Keras resolved ``training``, masks and autocast scopes.
    ``make_wrapper`` is called once per intercepted call, with ``original`` bound to that call's Keras call
    context (:class:`CallInContext`): a recompute that calls it later runs under the forward call's
    ``training`` value even when the op's ``call`` has no ``training`` argument.
    """
    patched = []
    try:
        for op in ops:
            if "_keras_lms_original_call" in op.__dict__:
                raise RuntimeError(
                    f"Layer {op.name!r} is already being intercepted by keras-lms (nested wrapped models sharing "
                    "layers are not supported). Wrap only the outermost model."
                )
            had_own = "call" in op.__dict__
            previous = op.__dict__.get("call")
            original = op.call
            object.__setattr__(op, "_keras_lms_original_call", original)
            object.__setattr__(op, "call", _intercepting_call(op, original, make_wrapper))
            patched.append((op, had_own, previous))
        yield
    finally:
        for op, had_own, previous in reversed(patched):
            if had_own:
                object.__setattr__(op, "call", previous)
            else:
                object.__delattr__(op, "call")
            object.__delattr__(op, "_keras_lms_original_call")
