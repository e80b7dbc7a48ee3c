"""The batch size a `fit` call will feed, known before Keras traces the step (the offload plan needs it).

Keras traces the training step with an unknown batch axis for `tf.data` without `drop_remainder`, Python
generators and `PyDataset` inputs; `LMSModel.fit` reads the batch size ahead with `peek_batch_size` (a peeked
generator is given back with its first batch re-inserted) and re-plans with `Replan` when a generator later
yields a larger batch.
"""

from __future__ import annotations

import types

import keras


def batch_size_of(x, batch_size):
    """The batch size `fit` will use, when it can be known without consuming the data."""
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return batch_size
    if isinstance(x, keras.utils.PyDataset):
        try:
            first = x[0]
        except Exception:  # a dataset that cannot be indexed up front: no hint
            return None
        return leading_dim(first[0] if isinstance(first, tuple) else first)
    element_spec = getattr(x, "element_spec", None)  # tf.data.Dataset
    if element_spec is not None:
        spec = element_spec[0] if isinstance(element_spec, tuple) else element_spec
        return leading_dim(spec)
    n = leading_dim(x)
    return None if n is None else min(32, n)  # Keras' default batch size for arrays


def _monitored(first, rest, model):
    """Re-yields a generator's batches (the peeked first one first) and notes a batch larger than the plan's."""
    largest = leading_dim(first[0] if isinstance(first, tuple) else first) or 0
    yield first
    for batch in rest:
        n = leading_dim(batch[0] if isinstance(batch, tuple) else batch)
        if n is not None and n > largest:
            largest = n
            if model.batch_size_hint is not None and n > model.batch_size_hint:
                model._pending_batch_hint = n
        yield batch


class Replan(keras.callbacks.Callback):
    """Re-plans the step (new trace) when a generator yielded a batch larger than the plan's."""

    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped

    def on_train_batch_begin(self, batch, logs=None):
        pending = getattr(self.wrapped, "_pending_batch_hint", None)
        if pending is not None and pending > (self.wrapped.batch_size_hint or 0):
            self.wrapped._pending_batch_hint = None
            self.wrapped.batch_size_hint = pending  # clears the plans: the next trace plans for this batch
            self.wrapped.make_train_function(force=True)


def peek_batch_size(x, batch_size, model):
    """`(x, batch)`: the data to hand to Keras (a peeked generator re-assembled) and its batch size or None."""
    hint = batch_size_of(x, batch_size)
    if hint is not None:
        return x, hint
    if isinstance(x, types.GeneratorType):
        try:
            first = next(x)
        except StopIteration:
            return x, None
        return _monitored(first, x, model), leading_dim(first[0] if isinstance(first, tuple) else first)
    if hasattr(x, "element_spec") and hasattr(x, "take"):  # tf.data with an unknown batch axis
        try:
            first = next(iter(x.take(1)))
        except (StopIteration, TypeError, ValueError):
            return x, None
        return x, leading_dim(first[0] if isinstance(first, tuple) else first)
    return x, None


def leading_dim(inputs):
    for leaf in keras.tree.flatten(inputs):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None
