"""Data for the segmentation examples: the entry point that picks the source and feeds it to Keras.

:func:`make_datasets` returns ``(train, val, channels)``: the synthetic lesion generator
(:mod:`examples.synthetic`, the default) or, with ``data_dir``, NIfTI volumes / PNG/TIFF tiles from a folder
(:mod:`examples.files`). Each is a :class:`keras.utils.PyDataset` sharded between Horovod ranks
(:mod:`examples.sharded`; ``rank`` and ``size``), deterministic given ``seed`` (and the epoch, for the training
split, which draws fresh samples / crops every epoch). :func:`to_tf_dataset` wraps one in a ``tf.data.Dataset``
with static batch shapes.
"""

from __future__ import annotations

import contextlib

import numpy as np

if __package__:  # imported as examples.data (python -m examples.segmentation_3d, the tests)
    from .files import DataFileError, ImageTiles, NiftiVolumes, find_pairs, split_pairs
    from .sharded import _Sharded
    from .synthetic import SyntheticLesions
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from files import DataFileError, ImageTiles, NiftiVolumes, find_pairs, split_pairs
    from sharded import _Sharded
    from synthetic import SyntheticLesions


def make_datasets(kind: str, spatial_shape, *, data_dir=None, batch_size=2, steps=None, val_steps=None,
                  seed=0, rank=0, size=1, val_fraction=0.2, workers=1, use_multiprocessing=False,
                  max_queue_size=10):
    """``(train, val, channels)`` for ``kind`` "3d" or "2d": synthetic unless ``data_dir`` is given."""
    loader = dict(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
    if data_dir is None:
        channels = 1 if kind == "3d" else 3
        train = SyntheticLesions(spatial_shape, channels, batch_size, steps or 20, seed=seed, split="train",
                                 rank=rank, size=size, **loader)
        val = SyntheticLesions(spatial_shape, channels, batch_size, val_steps or 2, seed=seed, split="val",
                               rank=rank, size=size, **loader)
        return train, val, channels
    cls = NiftiVolumes if kind == "3d" else ImageTiles
    train_pairs, val_pairs = split_pairs(find_pairs(data_dir, cls.suffixes), val_fraction)
    train = cls(train_pairs, spatial_shape, batch_size, steps, seed=seed, split="train", rank=rank, size=size,
                **loader)
    val = cls(val_pairs, spatial_shape, batch_size, val_steps, seed=seed, split="val", rank=rank, size=size,
              **loader)
    return train, val, train.channels


def datasets_for(args, task, rank: int, size: int):
    """``(train, val, channels)`` for the example's flags and this rank's shard (``make_datasets``)."""
    return make_datasets(
        task.kind, task.spatial_shape(args), data_dir=args.data_dir, batch_size=args.batch_size,
        steps=args.steps_per_epoch, val_steps=args.val_steps, seed=args.seed, rank=rank, size=size,
        val_fraction=args.val_fraction, workers=args.workers, use_multiprocessing=args.use_multiprocessing,
        max_queue_size=args.max_queue_size)


def fit_inputs(args, train, val):
    """What ``fit`` is given for ``--loader``: the PyDatasets themselves, or ``tf.data`` over them."""
    if args.loader == "tfdata":
        return to_tf_dataset(train, args.workers, args.max_queue_size), to_tf_dataset(val, args.workers,
                                                                                      args.max_queue_size)
    return train, val


def to_tf_dataset(dataset: _Sharded, parallel_calls: int = 1, prefetch: int = 2):
    """A ``tf.data.Dataset`` over the batches of ``dataset`` with *static* batch shapes, prefetched.

    Batch ``i`` is ``dataset[i]`` (computed by ``parallel_calls`` parallel, order-preserving calls), so the
    samples, sharding and per-epoch draws are exactly those of the PyDataset; call ``dataset.set_epoch(epoch)``
    at the start of each epoch (the examples' ``DataEpoch`` callback does).

    Why: Keras hands a PyDataset to the training step with an unknown (None) batch dimension, while a
    dataset with static shapes lets keras-lms see the real batch size when it plans what to offload.
    """
    import tensorflow as tf

    x_shape, y_shape = dataset.batch_shapes()

    def load(index):
        try:
            x, y = dataset[int(index)]
        except DataFileError as err:
            # tf.data re-raises it as a PyFunc/IteratorGetNext error whose traceback buries the file's name:
            # keep it, so data_errors_in_one_line can give the user the example's own line instead.
            dataset.data_error = err
            raise
        return x.astype(np.float32, copy=False), y.astype(np.float32, copy=False)

    def batch(index):
        x, y = tf.numpy_function(load, [index], (tf.float32, tf.float32), stateful=True)
        return tf.ensure_shape(x, x_shape), tf.ensure_shape(y, y_shape)

    ds = tf.data.Dataset.range(len(dataset))
    ds = ds.map(batch, num_parallel_calls=max(1, int(parallel_calls)), deterministic=True)
    return ds.prefetch(max(1, int(prefetch)))


class DataError(SystemExit):
    """A data file could not be read during training: the example exits with one line naming it."""


@contextlib.contextmanager
def data_errors_in_one_line(*datasets):
    """Turn an unreadable data file met while training into one line naming the file (exit status 1).

    Under ``--loader pydataset`` Keras re-raises the example's :class:`DataFileError` itself; under the default
    ``--loader tfdata`` TensorFlow wraps it in a ``PyFunc``/``IteratorGetNext`` error, so the original, recorded
    by :func:`to_tf_dataset` on the dataset, is used.
    """
    try:
        yield
    except Exception as err:
        recorded = next((d.data_error for d in datasets if getattr(d, "data_error", None) is not None), None)
        cause = err if isinstance(err, DataFileError) else recorded
        if cause is None:
            raise
        raise DataError(f"error: {cause}") from None
