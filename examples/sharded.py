"""The base of every example dataset: batches per epoch, Horovod rank sharding, epoch-keyed draws.

:class:`_Sharded` is a :class:`keras.utils.PyDataset` (``workers``, ``use_multiprocessing`` and
``max_queue_size`` are passed through, so Keras prefetches batches in worker threads or processes while the
model trains). Sample ``j`` of batch ``i`` on rank ``r`` is global sample ``(i * batch_size + j) * size + r``,
so ranks never see the same sample. :func:`_rng` makes every draw a function of integers only (seed, split,
epoch, sample number), so everything is deterministic across processes and runs.

Subclasses: :class:`~examples.synthetic.SyntheticLesions` and the file datasets of :mod:`examples.files`.
"""

from __future__ import annotations

import keras
import numpy as np

SPLITS = {"train": 0, "val": 1, "test": 2}


def _rng(*key) -> np.random.Generator:
    """A generator that depends only on the integers in ``key`` (stable across processes and runs)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


class _Sharded(keras.utils.PyDataset):
    """Common bookkeeping: batches per epoch, rank sharding, epoch counter (fresh draws for training)."""

    def __init__(self, *, batch_size, steps, seed, split, rank, size, workers, use_multiprocessing,
                 max_queue_size):
        super().__init__(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}; got {split!r}.")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size); got rank={rank}, size={size}.")
        if batch_size < 1 or steps < 1:
            raise ValueError(f"batch_size and steps must be >= 1; got {batch_size} and {steps}.")
        self.batch_size, self.steps, self.seed = int(batch_size), int(steps), int(seed)
        self.split, self.rank, self.size = split, int(rank), int(size)
        self.epoch = 0

    def __len__(self):
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        """Start drawing as for ``epoch`` (used when training resumes from a checkpoint)."""
        self.epoch = int(epoch)

    def on_epoch_end(self):
        if self.split == "train":
            self.epoch += 1

    def _epoch_key(self) -> int:
        return self.epoch if self.split == "train" else 0

    def sample_ids(self, index: int) -> list[int]:
        """Global sample numbers of batch ``index`` on this rank (disjoint between ranks)."""
        if not 0 <= index < self.steps:
            raise IndexError(f"batch index {index} out of range [0, {self.steps}).")
        return [(index * self.batch_size + j) * self.size + self.rank for j in range(self.batch_size)]

    def sample(self, gid: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index):
        pairs = [self.sample(g) for g in self.sample_ids(index)]
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])

    def batch_shapes(self):
        """Static shapes of one batch: ``((B, *shape, channels), (B, *shape, 1))``."""
        return ((self.batch_size, *self.shape, self.channels), (self.batch_size, *self.shape, 1))

