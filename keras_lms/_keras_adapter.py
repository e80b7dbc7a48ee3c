"""The only module that touches private Keras API.

keras-lms needs these things Keras 3 does not expose publicly:

* run a layer's *original* ``call`` statelessly while collecting only the losses that ``call`` adds
  (``Layer.stateless_call(return_losses=True)`` also returns weight-regularisation losses, which Keras
  adds again from ``model.losses``; counting them twice would change the loss);
* read a variable's stored value without the mixed-precision autocast that is active inside a layer call;
* intercept a layer call *after* ``Layer.__call__`` has resolved ``training``, masks and autocasting,
  which we do by shadowing the bound ``call`` method on the instance for the duration of one forward pass;
* clear the losses a throw-away planning trace left on the layers;
* re-enter, in the backward recompute, the Keras call context (``training`` and the other call-context
  arguments) that the forward call ran under (:class:`CallInContext`);
* on torch, flatten nested structures without the reference cycles Keras' torch tree utilities create
  (:func:`acyclic_torch_trees`), so a tensor dies when its last user drops it, not at the next garbage
  collection;
* on TensorFlow, replay BatchNormalization's batch statistics and a Dense/Conv layer's pre-activation in the
  recompute (:func:`batchnorm_moments_hook`, :func:`batchnorm_reduction_axes`, :func:`fused_activation`);
* for ``keras_lms.horovod``: key, list and save an optimizer's variables as Keras does
  (:func:`optimizer_variable_key`, :func:`optimizer_trainable_variables`, :func:`serialize_like`) and find
  RMSprop's momentum buffers (:func:`rmsprop_momentums`).

No other module of keras-lms imports ``keras.src`` or reads a private attribute of a Keras object
(``tests/test_keras_adapter.py`` greps the sources). Everything here is pinned to the Keras range in
pyproject.toml; ``tests/test_keras_adapter.py`` (and ``tests/torch/test_keras_adapter.py`` for the torch back
end) has a canary per assumption that fails loudly, naming the function, when a Keras release changes one; a
private attribute that is gone raises :class:`RuntimeError` naming the function and the Keras versions.
"""

from __future__ import annotations

import contextlib

import keras
from keras import StatelessScope
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.variables import AutocastScope
from keras.src.layers.layer import CallContext

from keras_lms._keras_support import SUPPORTED_KERAS, check_keras_version, is_quantized, patched_attribute

__all__ = [  # the last line: re-exported from keras_lms._keras_support (public Keras API only)
    "current_autocast_dtype", "run_stateless", "raw_values", "original_call", "CallInContext", "patched_calls",
    "clear_losses", "functional_operations", "get_mask", "set_mask", "compute_output_spec", "releasing_graph_runs",
    "acyclic_torch_trees", "batchnorm_moments_hook", "batchnorm_reduction_axes", "fused_activation",
    "optimizer_variable_key", "optimizer_trainable_variables", "rmsprop_momentums", "serialize_like",
    "SUPPORTED_KERAS", "check_keras_version", "is_quantized", "patched_attribute",
]


def _private(obj, name: str, function: str):
    """``obj.<name>``, a private Keras attribute ``function`` relies on; a clear error when Keras dropped it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(
            f"keras_lms._keras_adapter.{function}() relies on {type(obj).__name__}.{name}, private API of Keras "
            f"{SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} that Keras {keras.__version__} does not have. The adapter "
            "needs updating for this Keras (tests/test_keras_adapter.py names each assumption)."
        ) from None


def current_autocast_dtype():
    """The mixed-precision autocast dtype ``Layer.__call__`` set for the call in progress (None: no cast)."""
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def run_stateless(layer, call_fn, trainable_values, non_trainable_values, args, kwargs, autocast_dtype=None):
    """Run ``call_fn(*args, **kwargs)`` for ``layer`` with its variables mapped to the given values.

    Returns ``(outputs, new_non_trainable_values, call_losses)``; nothing is assigned. This is
    ``Layer.stateless_call`` minus weight-regularisation losses, and it takes the unpatched ``call``.
    Operations that are not layers (``keras.ops`` nodes of a functional graph) have no variables.
    ``autocast_dtype`` re-creates the autocast scope of the original call, so a recompute outside
    ``Layer.__call__`` casts variables exactly as the forward pass did.
    """
    trainable_vars = list(getattr(layer, "trainable_variables", []))
    non_trainable_vars = list(getattr(layer, "non_trainable_variables", []))
    mapping = list(zip(trainable_vars, trainable_values)) + list(zip(non_trainable_vars, non_trainable_values))
    with AutocastScope(autocast_dtype), StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        outputs = call_fn(*args, **kwargs)
    new_values = [scope.get_current_value(v) for v in non_trainable_vars]
    return outputs, new_values, list(scope.losses)


class _ReadRecordingScope(StatelessScope):
    """A StatelessScope that notes every variable whose value is read and otherwise defers to the scope it is
    entered in (its values, updates and losses), so the code it wraps runs exactly as without it.

    Keras 3.15's ``Variable.value`` asks the innermost stateless scope for ``get_current_value(variable)``; that
    lookup is what is recorded (canary: tests/test_keras_adapter.py).
    """

    def __init__(self):
        super().__init__(initialize_variables=False)
        self.read = {}  # id -> variable, in first-read order

    def __enter__(self):
        super().__enter__()
        self.collect_losses = bool(self.original_scope is not None and self.original_scope.collect_losses)
        return self

    def get_current_value(self, variable):
        self.read.setdefault(id(variable), variable)
        outer = self.original_scope
        return outer.get_current_value(variable) if outer is not None else None

    def add_update(self, update):
        if self.original_scope is not None:
            self.original_scope.add_update(update)
        else:
            super().add_update(update)

    def add_loss(self, loss):
        if self.original_scope is not None:
            self.original_scope.add_loss(loss)
        else:
            super().add_loss(loss)


@contextlib.contextmanager
def recording_variable_reads():
    """Within the block, note every Keras variable whose value is read; yields the list (filled on exit).

    The planning trace uses it to find layers that read trainable variables they do not own (tied weights),
    whose gradients the torch recompute cannot return. Values, updates and losses behave as without it.
    """
    read = []
    with _ReadRecordingScope() as scope:
        yield read
    read.extend(scope.read.values())


def raw_values(variables):
    """Current values of ``variables`` in their storage dtype (no mixed-precision autocast).

    Inside an outer StatelessScope (e.g. someone calls ``stateless_call`` on the wrapped model) the
    scope's values are the current ones.
    """
    scope = get_stateless_scope()
    values = []
    with AutocastScope(None):
        for v in variables:
            value = scope.get_current_value(v) if scope is not None else None
            values.append(v.value if value is None else value)
    return values


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


def clear_losses(layer) -> None:
    """Drop losses that ``add_loss`` left on ``layer`` and its sublayers (e.g. from a planning trace)."""
    layer._clear_losses()


def functional_operations(model):
    """All operations of a functional graph (layers and ``keras.ops`` nodes), without InputLayers."""
    ops = getattr(model, "_operations", None)
    if ops is None:
        return None
    return [op for op in ops if not isinstance(op, keras.layers.InputLayer)]


def get_mask(x):
    """The Keras mask attached to a tensor, or None."""
    from keras.src.backend.common.masking import get_keras_mask

    try:
        return get_keras_mask(x)
    except AttributeError:  # pragma: no cover - tensors that cannot carry attributes
        return None


def set_mask(x, mask) -> None:
    """Attach a Keras mask to a tensor (what ``Layer.__call__`` does for layers that support masking)."""
    from keras.src.backend.common.masking import set_keras_mask

    if mask is not None:
        set_keras_mask(x, mask)


def batchnorm_moments_hook(layer):
    """Name of the BatchNormalization method that computes batch statistics, when it can be hooked.

    Keras' BatchNormalization.call gets (mean, variance) from ``self._moments(inputs, mask)``; renorm and
    synchronized BatchNorm do more than that, so they are not hooked.
    """
    if (type(layer).call is keras.layers.BatchNormalization.call and not getattr(layer, "renorm", False)
            and not getattr(layer, "synchronized", False) and hasattr(layer, "_moments")):
        return "_moments"
    return None


def batchnorm_reduction_axes(layer, inputs) -> list[int]:
    """The axes BatchNormalization's ``_moments`` reduces ``inputs`` over: every axis but ``layer.axis``.

    Why: the TensorFlow back end gives the recompute the forward's batch statistics with their exact gradient,
    which needs these axes. Keras 3.15 stores them in ``build`` as the private ``_reduction_axes``
    (``range(ndim)`` without ``axis``); this derives the same list from the public ``axis`` and the input's rank.
    """
    ndim = len(inputs.shape)
    return [i for i in range(ndim) if i != layer.axis % ndim]


def fused_activation(layer):
    """The activation a Dense/Conv-family layer's own ``call`` applies last, as stored on the instance.

    Why: the TensorFlow back end recomputes such a layer's pre-activation by shadowing ``activation`` on the
    instance with ``linear``, then restores what this returns. Keras 3.15's Dense, EinsumDense and convolution
    layers store it as an instance attribute in ``__init__`` and their ``call`` reads ``self.activation`` at call
    time; reading the instance dict (not the attribute) makes the restore exact.
    """
    try:
        return vars(layer)["activation"]
    except (KeyError, TypeError):
        raise RuntimeError(
            f"keras_lms._keras_adapter.fused_activation() expects {type(layer).__name__} to store `activation` on "
            f"the instance, as Keras {SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} does; Keras {keras.__version__} does "
            "not. The adapter needs updating for this Keras."
        ) from None


def compute_output_spec(fn, *args, **kwargs):
    """Run ``fn`` on symbolic stand-ins of ``args`` (KerasTensors) with Keras' own shape inference.

    Nothing is computed and no state changes (Keras runs it under a StatelessScope); the torch back end runs
    ``fn`` on "meta" tensors (falling back to real tensors when an op has no meta kernel).

    Keras runs both torch attempts in the *same* StatelessScope, so state updates of a failed meta attempt
    (BatchNorm moving statistics, seed states: meta tensors) would leak into the real-tensor retry and fail it
    ("Tensor on device cpu is not on the expected device meta", e.g. BatchNormalization before UpSampling2D,
    which has no meta kernel). Every attempt here starts from the scope's state at the first one.
    """
    from keras.src import backend

    return backend.compute_output_spec(_from_first_attempt_state(fn), *args, **kwargs)


def _from_first_attempt_state(fn):
    """``fn``, run each time from the StatelessScope state (updates, losses) its first run started from."""
    initial = []

    def attempt(*args, **kwargs):
        scope = get_stateless_scope()
        if scope is not None:
            if not initial:
                initial.append((dict(scope.state_mapping), list(scope.losses)))
            state, losses = initial[0]
            scope.state_mapping.clear()
            scope.state_mapping.update(state)
            scope.losses[:] = losses
        return fn(*args, **kwargs)

    return attempt


def _functional_graphs(models):
    """The ``Function`` objects (functional graphs) that run the given models' calls."""
    graphs, seen = [], set()
    for m in models:
        for candidate in (m, getattr(m, "_functional", None)):  # Sequential runs through its _functional
            if isinstance(candidate, keras.Function) and id(candidate) not in seen:
                seen.add(id(candidate))
                graphs.append(candidate)
    return graphs


def _releasing_run_through_graph(fn, inputs, operation_fn=lambda op: op, call_fn=None):
    """``Function._run_through_graph`` (Keras 3.15) that drops each intermediate tensor after its last consumer.

    Keras keeps every intermediate tensor of a functional graph in a local dict until the whole forward pass
    returns. In graph mode (tf.function) that costs nothing, but in eager back ends (torch) it keeps every
    activation on the device until the end of the forward pass, defeating offloading.
    """
    tree = keras.tree
    inputs = tree.flatten(inputs)
    tensor_dict = {}
    for x, y in zip(fn.inputs, inputs):
        tensor_dict[id(x)] = y
    nodes_by_depth = fn._nodes_by_depth
    depth_keys = sorted(nodes_by_depth.keys(), reverse=True)
    remaining = {}
    for depth in depth_keys:
        for node in nodes_by_depth[depth]:
            if node.operation and not node.is_input:
                for x in node.input_tensors:
                    remaining[id(x)] = remaining.get(id(x), 0) + 1
    output_ids = {id(x) for x in fn.outputs}
    for depth in depth_keys:
        for node in nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            if any(id(x) not in tensor_dict for x in node.input_tensors):
                continue
            args, kwargs = node.arguments.fill_in(tensor_dict)
            if call_fn is not None:
                outputs = call_fn(operation_fn(node.operation), *args, **kwargs)
            else:
                outputs = operation_fn(fn._get_operation_for_node(node))(*args, **kwargs)
            del args, kwargs
            for x, y in zip(node.outputs, tree.flatten(outputs)):
                tensor_dict[id(x)] = y
            del outputs
            for x in node.input_tensors:
                remaining[id(x)] -= 1
                if remaining[id(x)] == 0 and id(x) not in output_ids:
                    tensor_dict.pop(id(x), None)
    output_tensors = []
    for i, x in enumerate(fn.outputs):
        if id(x) not in tensor_dict:
            path = tree.flatten_with_path(fn._outputs_struct)[i][0]
            path = ".".join(str(p) for p in path)
            raise ValueError(f"Output with path `{path}` is not connected to `inputs`")
        output_tensors.append(tensor_dict[id(x)])
    return tree.pack_sequence_as(fn._outputs_struct, output_tensors)


@contextlib.contextmanager
def releasing_graph_runs(models):
    """Within the block, functional graphs of ``models`` free intermediate tensors after their last use.

    Shadows ``_run_through_graph`` on each graph instance (see :func:`_releasing_run_through_graph`); the
    results are identical, only Python references are dropped earlier.
    """
    import types

    patched = []
    try:
        for graph in _functional_graphs(models):
            if "_run_through_graph" in graph.__dict__:
                continue  # already releasing (nested use)
            object.__setattr__(graph, "_run_through_graph",
                               types.MethodType(_releasing_run_through_graph, graph))
            patched.append(graph)
        yield
    finally:
        for graph in reversed(patched):
            object.__delattr__(graph, "_run_through_graph")


# Note: [Keras' torch trees keep tensors alive until the cyclic garbage collector runs]
# keras/src/tree/torchtree_impl.py (Keras 3.15) flattens one level of a structure with
# ``torch_tree.tree_flatten(structure, is_leaf=lambda x: x is not structure)`` in ``_dict_to_ordered_dict`` and
# ``traverse``. torch's ``tree_flatten`` recurses through a nested function ``helper`` that refers to itself:
# ``helper -> its closure cell -> helper`` is a reference cycle, and the same closure holds ``is_leaf``, whose
# closure holds ``structure``. So every ``keras.tree.flatten`` of a nested structure (each Layer.__call__ does
# several) keeps the structure and every tensor in it alive until Python's cyclic collector runs. On an eager
# device that keeps offloaded activations (and the recompute's temporaries) on the device for a random time.
# The replacements below are the Keras functions with one change: ``is_leaf`` compares by ``id`` and holds no
# reference to ``structure`` (which is alive for the whole call, so the test is exact).


class _IsNot:
    """``is_leaf`` for one-level flattening: true for everything but the object with this id (no reference)."""

    __slots__ = ("ident",)

    def __init__(self, obj):
        self.ident = id(obj)

    def __call__(self, x):
        return id(x) != self.ident


def _acyclic_dict_to_ordered_dict(structure):
    """``torchtree_impl._dict_to_ordered_dict`` (Keras 3.15) without the reference cycle (see the note above)."""
    from collections import defaultdict

    from keras.src.tree import torchtree_impl as impl

    torch_tree = impl.torch_tree
    if type(structure) is dict:
        return {k: structure[k] for k in sorted(structure.keys())}
    if type(structure) is defaultdict:
        return defaultdict(structure.default_factory, {k: structure[k] for k in sorted(structure.keys())})
    children, treedef = torch_tree.tree_flatten(structure, is_leaf=_IsNot(structure))
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return structure
    return torch_tree.tree_unflatten([impl._dict_to_ordered_dict(c) for c in children], treedef)


def _acyclic_traverse(func, structure, top_down=True):
    """``torchtree_impl.traverse`` (Keras 3.15) without the reference cycle (see the note above)."""
    from keras.src.tree import torchtree_impl as impl

    torch_tree = impl.torch_tree

    def traverse_children(node):
        children, treedef = torch_tree.tree_flatten(node, is_leaf=_IsNot(node))
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            return node
        return torch_tree.tree_unflatten([impl.traverse(func, c, top_down=top_down) for c in children], treedef)

    structure = impl._dict_to_ordered_dict(structure)
    if top_down:
        ret = func(structure)
        if ret is None:
            return traverse_children(structure)
    else:
        traversed_structure = traverse_children(structure)
        ret = func(traversed_structure)
        if ret is None:
            return traversed_structure
    if isinstance(ret, type) and ret.__name__ == "MAP_TO_NONE":
        return None
    return ret


_ACYCLIC_LOCK = __import__("threading").Lock()
_ACYCLIC_DEPTH = [0, None]  # [holders, the original functions while installed]


@contextlib.contextmanager
def acyclic_torch_trees():
    """Within the block (any thread), Keras' torch tree utilities create no reference cycles.

    Process-wide and reentrant (a counter under a lock): the forward pass of a wrapped step and each backward
    recompute hold it; the originals come back when the last holder leaves. A no-op on other back ends.
    """
    if keras.backend.backend() != "torch":
        yield
        return
    from keras.src.tree import torchtree_impl as impl

    with _ACYCLIC_LOCK:
        if _ACYCLIC_DEPTH[0] == 0:
            _ACYCLIC_DEPTH[1] = (impl._dict_to_ordered_dict, impl.traverse)
            impl._dict_to_ordered_dict, impl.traverse = _acyclic_dict_to_ordered_dict, _acyclic_traverse
        _ACYCLIC_DEPTH[0] += 1
    try:
        yield
    finally:
        with _ACYCLIC_LOCK:
            _ACYCLIC_DEPTH[0] -= 1
            if _ACYCLIC_DEPTH[0] == 0:
                impl._dict_to_ordered_dict, impl.traverse = _ACYCLIC_DEPTH[1]
                _ACYCLIC_DEPTH[1] = None


# ------------------------------------------------------------------------------ optimizers (keras_lms.horovod)
def optimizer_variable_key(optimizer, variable):
    """The key ``optimizer`` indexes ``variable``'s state by (``Optimizer._var_key``, Keras 3.15).

    Why: the Horovod optimizer keys its own per-variable state (local-gradient registrations, accumulators,
    allreduce groups) as Keras does, so that a ``keras.Variable`` and the backend variable it wraps are one
    variable (on TensorFlow the key is the ``tf.Variable``'s unique id).
    """
    return _private(optimizer, "_var_key", "optimizer_variable_key")(variable)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a built ``optimizer`` was built with (``BaseOptimizer._trainable_variables``, Keras 3.15).

    Why: ``apply(grads)`` without variables applies to these (Horovod must know which gradient is whose), and
    wrapping a built optimizer builds the copy on the same list; Keras has no public accessor.
    """
    return list(_private(optimizer, "_trainable_variables", "optimizer_trainable_variables"))


def rmsprop_momentums(optimizer) -> list:
    """A built ``keras.optimizers.RMSprop``'s momentum buffers (``RMSprop._momentums``, Keras 3.15).

    Why: the Horovod learning-rate callbacks rescale momentum buffers when the rate changes; SGD's are public
    (``SGD.momentums``), RMSprop's are not. Empty when ``momentum`` is 0.
    """
    return list(_private(optimizer, "_momentums", "rmsprop_momentums"))


def serialize_like(cls: type, base: type) -> None:
    """Make Keras serialise instances of ``cls`` (a subclass of ``base``) exactly as instances of ``base``.

    Why: ``keras_lms.horovod.DistributedOptimizer`` returns an instance of a subclass made on the fly, and a
    model saved with it must load without keras-lms or Horovod, as the plain optimizer. Keras 3.15's
    ``serialize_keras_object`` names a class by its ``keras.*`` export, held in the private registry
    ``keras.src.api_export.REGISTERED_OBJS_TO_NAMES`` (no public writer), else by its registered custom name,
    which the public ``keras.saving.register_keras_serializable`` writes.
    """
    from keras.src import api_export

    exported = _private(api_export, "REGISTERED_OBJS_TO_NAMES", "serialize_like")
    public = api_export.get_name_from_symbol(base)
    if public is not None:
        exported[cls] = public
    name = keras.saving.get_registered_name(base)
    if name != base.__name__:  # ``base`` is registered as "package>name"
        package, _, short = name.partition(">")
        keras.saving.register_keras_serializable(package, short)(cls)
        keras.saving.register_keras_serializable(package, short)(base)  # the name still deserialises ``base``
