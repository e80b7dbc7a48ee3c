"""Torch trees: flatten nested structures on torch without the reference cycles Keras' tree utilities create.

Keras internals relied on (Keras 3.15), and why: ``keras.src.tree.torchtree_impl`` — its ``_dict_to_ordered_dict``
and ``traverse`` (replaced, module-wide, while :func:`acyclic_torch_trees` is held) and the ``torch_tree``
module it uses. Keras' versions keep every structure they flatten alive until Python's cyclic garbage collector
runs, which keeps offloaded activations on the device for a random time (the note below); the replacements are
the Keras functions with only that changed. Canaries: ``tests/offload/torch/test_keras_adapter.py``.
"""

from __future__ import annotations

import contextlib
import threading

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


_ACYCLIC_LOCK = threading.Lock()
_ACYCLIC_DEPTH = [0, None]  # [holders, the original functions while installed]


@contextlib.contextmanager
def acyclic_torch_trees():
    """Within the block (any thread), Keras' torch tree utilities create no reference cycles.

    Process-wide and reentrant (a counter under a lock): the torch back end's forward pass of a wrapped step and
    each backward recompute hold it; the originals come back when the last holder leaves.
    """
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
