"""Functional graphs: list their operations, infer output specs, and run them releasing intermediate tensors.

Keras internals relied on (Keras 3.15), and why:

* ``Functional._operations`` (the graph's operations, InputLayers included): the planner's units are the
  operations of a functional model, ``keras.ops`` nodes as well as layers;
* ``Sequential._functional``: a built Sequential runs its calls through this ``keras.Function``;
* ``Function._run_through_graph`` and what it reads (``_nodes_by_depth``, ``_get_operation_for_node``,
  ``_outputs_struct``, ``Node.arguments.fill_in``): Keras keeps every intermediate tensor of a functional
  graph in a local dict until the whole forward pass returns, which on an eager back end (torch) keeps every
  activation on the device and defeats offloading; :func:`releasing_graph_runs` shadows it on the instance with
  a copy that drops each tensor after its last consumer;
* ``keras.src.backend.compute_output_spec``: Keras' own shape inference on symbolic stand-ins; on torch it runs
  a meta-tensor attempt and a real-tensor retry in the same ``StatelessScope`` (read through
  ``keras.src.backend.common.stateless_scope.get_stateless_scope``: its ``state_mapping`` and ``losses``), so
  :func:`compute_output_spec` restarts each attempt from the first one's state.
"""

from __future__ import annotations

import contextlib

import keras
from keras.src.backend.common.stateless_scope import get_stateless_scope


def functional_operations(model):
    """All operations of a functional graph (layers and ``keras.ops`` nodes), without InputLayers."""
    ops = getattr(model, "_operations", None)
    if ops is None:
        return None
    return [op for op in ops if not isinstance(op, keras.layers.InputLayer)]


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
