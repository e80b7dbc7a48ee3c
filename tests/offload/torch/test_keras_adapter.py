"""torch back end: what keras_lms/_keras_adapter/ relies on where the torch back end differs."""

import keras
import numpy as np
import torch

from keras_lms import _keras_adapter as adapter


def test_meta_fallback_retry_starts_from_the_first_attempts_state():
    """Keras' torch compute_output_spec retries on real tensors when an op has no meta kernel (UpSampling2D),
    in the same StatelessScope: the BatchNorm statistics the meta attempt stored there must not reach the
    retry (they are meta tensors). This is the planning trace of every wrapped model."""
    inp = keras.Input((8, 8, 2))
    model = keras.Model(inp, keras.layers.UpSampling2D()(keras.layers.BatchNormalization()(inp)))
    spec = adapter.compute_output_spec(lambda t: model(t, training=True), keras.KerasTensor((2, 8, 8, 2)))
    assert tuple(spec.shape) == (2, 16, 16, 2)
    assert not any(v.value.is_meta for v in model.variables)


def test_call_in_context_replays_training_on_torch():
    """The torch recompute runs in the autograd backward (outside Layer.__call__): the replayed context turns
    the inner Dropout of a composite layer without ``training`` on."""

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.drop = keras.layers.Dropout(0.5)

        def call(self, x):
            return self.drop(x)

    block = Block()
    inp = keras.Input((64,))
    model = keras.Model(inp, block(inp))
    bound = []
    with adapter.patched_calls([block], lambda op, original: bound.append(original) or original):
        model(torch.ones(4, 64), training=True)
    x = torch.ones(4, 64)
    assert torch.equal(block.call(x), x)  # outside any call context: inference mode
    dropped = bound[0](x)
    assert 0.2 < float((dropped == 0).float().mean()) < 0.8
    np.testing.assert_array_equal(np.unique(dropped.numpy()), [0.0, 2.0])


def test_keras_torch_trees_keep_tensors_in_reference_cycles_and_the_workaround_does_not():
    """Canary and fix for issue 15. Keras 3.15's torch ``keras.tree.flatten`` (torchtree_impl._dict_to_ordered_dict)
    passes ``is_leaf=lambda x: x is not structure`` to torch's ``tree_flatten``, whose recursive nested ``helper``
    is a reference cycle holding that lambda: the flattened tensors live until Python's cyclic collector runs.
    If this canary fails, Keras or torch fixed it and ``acyclic_torch_trees`` can go."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    def flattened_storage_survives():
        x = torch.rand(16)
        ref = StorageWeakRef(x.untyped_storage())
        keras.tree.flatten(((x, 1), {"b": x}))
        del x
        return not ref.expired()

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        assert flattened_storage_survives()  # Keras as it is: alive until a collection
        with adapter.acyclic_torch_trees(), adapter.acyclic_torch_trees():  # reentrant
            assert not flattened_storage_survives()
        assert flattened_storage_survives()  # the originals are back
    finally:
        if was:
            gc.enable()


def test_acyclic_torch_trees_give_keras_results():
    """The replacements of torchtree_impl._dict_to_ordered_dict / traverse change references, never results."""
    import collections

    Point = collections.namedtuple("Point", "a b")
    t = torch.ones(2)
    structures = [t, (t, [t, {"z": t, "a": (t,)}]), {"b": 1, "a": [t, None]}, collections.defaultdict(list, {"y": [t]}),
                  Point(t, [t, 2]), [], (), {"k": ()}, [[[]]]]
    expected = [(keras.tree.flatten(s), keras.tree.lists_to_tuples(s),
                 keras.tree.map_structure(lambda v: v, s)) for s in structures]
    with adapter.acyclic_torch_trees():
        got = [(keras.tree.flatten(s), keras.tree.lists_to_tuples(s),
                keras.tree.map_structure(lambda v: v, s)) for s in structures]
    for (flat_e, tup_e, map_e), (flat_g, tup_g, map_g) in zip(expected, got):
        assert len(flat_e) == len(flat_g) and all(a is b for a, b in zip(flat_e, flat_g))
        assert repr(tup_e) == repr(tup_g) and type(tup_e) is type(tup_g)
        assert repr(map_e) == repr(map_g) and type(map_e) is type(map_g)
