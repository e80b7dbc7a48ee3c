"""The synthetic lesion generator, the examples' default data (no download, 2D or 3D).

:func:`synthetic_sample` draws one ``(image, label)`` pair: a noisy 2D image or 3D volume with a smooth
multiplicative intensity bias field, faint "anatomy" blobs that are *not* lesions, and 1..``max_lesions``
randomly rotated ellipsoid (3D) / ellipse (2D) lesions of varying size and contrast; the label is the lesion
mask. A voxel threshold does not solve it (bias field, noise, distractors, low-contrast lesions), a small U-Net
learns it in minutes. :class:`SyntheticLesions` serves batches of it as a sharded PyDataset
(:mod:`examples.sharded`): a function of (seed, split, epoch, global sample number).
"""

from __future__ import annotations

import math

import numpy as np

if __package__:  # imported as examples.synthetic (python -m examples.segmentation_3d, the tests)
    from .sharded import SPLITS, _rng, _Sharded
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from sharded import SPLITS, _rng, _Sharded


# ------------------------------------------------------------------------------------------------ helpers
def _random_rotation(rng: np.random.Generator, ndim: int) -> np.ndarray:
    if ndim == 2:
        theta = rng.uniform(0, np.pi)
        c, s = np.cos(theta), np.sin(theta)
        return np.array([[c, -s], [s, c]])
    q, r = np.linalg.qr(rng.normal(size=(ndim, ndim)))
    return q * np.sign(np.diag(r))  # uniform over O(n); the sign of the determinant does not matter here


def _grid(shape, lo, hi):
    """Open grid (broadcastable 1-D coordinate arrays) for the box [lo, hi) in voxel units."""
    return [np.arange(a, b, dtype=np.float32).reshape([-1 if k == i else 1 for k in range(len(shape))])
            for i, (a, b) in enumerate(zip(lo, hi))]


def _ellipsoid(shape, center, radii, rotation):
    """Box slices and the normalised quadratic form q (q <= 1 inside) of a rotated ellipsoid."""
    reach = float(max(radii)) + 1.0
    lo = [max(0, int(math.floor(c - reach))) for c in center]
    hi = [min(s, int(math.ceil(c + reach)) + 1) for s, c in zip(shape, center)]
    if any(b <= a for a, b in zip(lo, hi)):
        return None, None
    axes = [g - c for g, c in zip(_grid(shape, lo, hi), center)]
    q = 0.0
    for k in range(len(shape)):  # coordinate along the ellipsoid's k-th principal axis
        u = sum(float(rotation[i, k]) * axes[i] for i in range(len(shape)))
        q = q + (u / float(radii[k])) ** 2
    return tuple(slice(a, b) for a, b in zip(lo, hi)), q.astype(np.float32)


def _bias_field(rng, shape, strength):
    """exp(low-order polynomial in normalised coordinates): smooth, multiplicative, about 0.6..1.6."""
    coords = [np.linspace(-1, 1, s, dtype=np.float32).reshape([-1 if k == i else 1 for k in range(len(shape))])
              for i, s in enumerate(shape)]
    log_field = np.zeros([1] * len(shape), np.float32)
    for i, x in enumerate(coords):
        log_field = log_field + rng.normal(0, strength) * x + rng.normal(0, strength / 2) * (x * x - 0.33)
        for y in coords[i + 1:]:
            log_field = log_field + rng.normal(0, strength / 2) * x * y
    return np.exp(np.broadcast_to(log_field, shape)).astype(np.float32)


def synthetic_sample(rng: np.random.Generator, shape, channels: int = 1, *, max_lesions: int | None = None,
                     radius_range=None, contrast_range=(0.15, 0.5), noise_range=(0.05, 0.12),
                     bias_strength=0.25, distractors: int = 3):
    """One ``(image, label)`` pair: image float32 ``shape + (channels,)`` (standardised per sample and channel),
    label float32 ``shape + (1,)`` in {0, 1} with at least one lesion. Works for 2D and 3D ``shape``.

    Defaults: 3D up to 4 lesions with radii 6-18 % of the edge, 2D up to 8 with radii 3-10 %. Lesion contrast
    (``contrast_range``, in units of the background intensity 0.5) and noise sigma (``noise_range``) are drawn
    per lesion / per sample, so some lesions are barely visible.
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    if max_lesions is None:
        max_lesions = 4 if ndim == 3 else 8
    if radius_range is None:
        radius_range = (0.06, 0.18) if ndim == 3 else (0.03, 0.10)
    edge = float(min(shape))
    tissue = np.full(shape, 0.5, np.float32)
    # Faint, smooth "anatomy" (Gaussian bumps): structure that is not a lesion.
    for _ in range(int(rng.integers(0, distractors + 1))):
        center = [rng.uniform(0.1, 0.9) * s for s in shape]
        radii = rng.uniform(0.12, 0.3, size=ndim) * edge
        box, q = _ellipsoid(shape, center, radii, _random_rotation(rng, ndim))
        if box is not None:
            tissue[box] += np.float32(rng.uniform(-0.12, 0.12)) * np.exp(-2.0 * q)
    if channels == 1:
        colour = np.ones(1, np.float32)
        directions = np.ones((max_lesions, 1), np.float32)
    else:  # colour images: stained-tissue colour; lesions shift it, mostly darker and bluer
        colour = np.clip(np.array([0.9, 0.62, 0.78] + [0.7] * (channels - 3), np.float32)[:channels]
                         + rng.normal(0, 0.05, channels).astype(np.float32), 0.3, 1.0)
        base = np.array([-0.7, -0.6, -0.2] + [-0.5] * (channels - 3), np.float32)[:channels]
        directions = base + rng.normal(0, 0.2, size=(max_lesions, channels)).astype(np.float32)
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    image = np.multiply.outer(tissue, colour)
    del tissue
    label = np.zeros(shape, bool)
    for k in range(int(rng.integers(1, max_lesions + 1))):
        radii = np.maximum(rng.uniform(*radius_range, size=ndim) * edge, 1.0)
        center = [rng.uniform(r + 1, s - r - 1) if s > 2 * r + 2 else s / 2 for s, r in zip(shape, radii)]
        box, q = _ellipsoid(shape, center, radii, _random_rotation(rng, ndim))
        if box is None:
            continue
        inside = q <= 1.0
        contrast = rng.uniform(*contrast_range)
        profile = np.where(inside, contrast * (0.75 + 0.25 * (1.0 - q)), 0.0).astype(np.float32)
        image[box] += profile[..., None] * directions[k]
        label[box] |= inside
    image *= _bias_field(rng, shape, bias_strength)[..., None]
    noise = rng.standard_normal(image.shape, dtype=np.float32)
    noise *= np.float32(rng.uniform(*noise_range))
    image += noise
    del noise
    axes = tuple(range(ndim))
    image -= image.mean(axis=axes, dtype=np.float64, keepdims=True).astype(np.float32)
    std = np.sqrt(np.square(image).mean(axis=axes, dtype=np.float64, keepdims=True)).astype(np.float32)
    image /= std + np.float32(1e-6)
    return image, label[..., None].astype(np.float32)


class SyntheticLesions(_Sharded):
    """Synthetic lesion segmentation, 2D (``shape=(H, W)``) or 3D (``shape=(D, H, W)``).

    Args:
        shape: spatial shape of one sample.
        channels: image channels (1 for "MRI-like" volumes, 3 for RGB tiles).
        batch_size, steps: batch size and batches per epoch (per rank).
        seed: everything is a function of (seed, split, epoch, global sample number).
        split: "train" draws fresh samples every epoch; "val"/"test" are fixed sets.
        rank, size: Horovod rank and world size (sharding).
        workers, use_multiprocessing, max_queue_size: PyDataset prefetching options.
        **generator: passed to :func:`synthetic_sample` (max_lesions, contrast_range, noise_range, ...).
    """

    def __init__(self, shape, channels=1, batch_size=2, steps=10, *, seed=0, split="train", rank=0, size=1,
                 workers=1, use_multiprocessing=False, max_queue_size=10, **generator):
        super().__init__(batch_size=batch_size, steps=steps, seed=seed, split=split, rank=rank, size=size,
                         workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self.shape, self.channels, self.generator = tuple(int(s) for s in shape), int(channels), generator
        if len(self.shape) not in (2, 3):
            raise ValueError(f"shape must be (H, W) or (D, H, W); got {shape}.")

    def sample(self, gid: int):
        rng = _rng(self.seed, SPLITS[self.split], self._epoch_key(), gid, len(self.shape))
        return synthetic_sample(rng, self.shape, self.channels, **self.generator)


