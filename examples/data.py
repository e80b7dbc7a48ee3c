"""Data for the segmentation examples: an embedded synthetic lesion generator and real-data folders.

Everything here is a :class:`keras.utils.PyDataset` (``workers``, ``use_multiprocessing`` and ``max_queue_size``
are passed through, so Keras prefetches batches in worker threads or processes while the model trains).

* :class:`SyntheticLesions` -- the default: noisy 2D images or 3D volumes with a smooth multiplicative intensity
  bias field, faint "anatomy" blobs that are *not* lesions, and 1..``max_lesions`` randomly rotated ellipsoid
  (3D) / ellipse (2D) lesions of varying size and contrast. The label is the lesion mask. A voxel threshold does
  not solve it (bias field, noise, distractors, low-contrast lesions), a small U-Net learns it in minutes.
* :class:`NiftiVolumes` -- ``*_image.nii.gz`` / ``*_label.nii.gz`` pairs (BraTS-like; 3D or 4D images, the 4th
  axis is channels), cropped/padded to a cube. Labels > 0 are foreground (e.g. BraTS "whole tumour").
* :class:`ImageTiles` -- ``*_image.{png,tif,tiff}`` / ``*_label.{png,tif,tiff}`` pairs (satellite/pathology
  tiles), read with Pillow or tifffile, converted to RGB, cropped/padded to a square.

Sharding for Horovod: every dataset takes ``rank`` and ``size``. Synthetic sample ``j`` of batch ``i`` on rank
``r`` is global sample ``(i * batch_size + j) * size + r``, so ranks never see the same sample; real data is
split file-wise (``files[rank::size]``). Everything is deterministic given ``seed`` (and the epoch, for the
training split, which draws fresh samples / crops every epoch).
"""

from __future__ import annotations

import math
import pathlib
import threading
from collections import OrderedDict

import keras
import numpy as np

SPLITS = {"train": 0, "val": 1, "test": 2}
IMAGE_SUFFIXES = (".png", ".tif", ".tiff")


# ------------------------------------------------------------------------------------------------ helpers
def _rng(*key) -> np.random.Generator:
    """A generator that depends only on the integers in ``key`` (stable across processes and runs)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


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


# ------------------------------------------------------------------------------------------- base dataset
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


# ---------------------------------------------------------------------------------------------- real data
def crop_or_pad(array: np.ndarray, shape, start=None, pad_value=0.0) -> np.ndarray:
    """Crop/pad the leading ``len(shape)`` axes of ``array`` to ``shape``.

    ``start`` gives the crop origin per axis (None: centred); axes smaller than ``shape`` are padded
    symmetrically with ``pad_value``.
    """
    shape = tuple(int(s) for s in shape)
    out = array
    slices, pads = [], []
    for axis, want in enumerate(shape):
        have = array.shape[axis]
        if have >= want:
            s = (have - want) // 2 if start is None else int(np.clip(start[axis], 0, have - want))
            slices.append(slice(s, s + want))
            pads.append((0, 0))
        else:
            slices.append(slice(None))
            before = (want - have) // 2
            pads.append((before, want - have - before))
    out = out[tuple(slices)]
    if any(p != (0, 0) for p in pads):
        pads += [(0, 0)] * (out.ndim - len(shape))
        out = np.pad(out, pads, constant_values=pad_value)
    return out


def find_pairs(data_dir, suffixes) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """``(image, label)`` path pairs named ``<stem>_image<suffix>`` / ``<stem>_label<suffix'>``, sorted."""
    data_dir = pathlib.Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"--data-dir {str(data_dir)!r} is not a directory.")
    labels = {}
    for path in data_dir.rglob("*_label*"):
        for suffix in suffixes:
            if path.name.lower().endswith("_label" + suffix):
                labels[(path.parent, path.name[: -len("_label" + suffix)])] = path
    pairs = []
    for path in sorted(data_dir.rglob("*_image*")):
        for suffix in suffixes:
            if path.name.lower().endswith("_image" + suffix):
                key = (path.parent, path.name[: -len("_image" + suffix)])
                if key in labels:
                    pairs.append((path, labels[key]))
                break
    if not pairs:
        raise FileNotFoundError(
            f"No image/label pairs in {str(data_dir)!r}: expected files named NAME_image{suffixes[0]} and "
            f"NAME_label{suffixes[0]} (also {', '.join(suffixes[1:])})."
        )
    return pairs


def split_pairs(pairs, val_fraction: float):
    """Deterministic train/val split by file (the last ``val_fraction`` of the sorted list is validation)."""
    if len(pairs) < 2 or val_fraction <= 0:
        return list(pairs), list(pairs)
    n_val = min(len(pairs) - 1, max(1, int(round(len(pairs) * val_fraction))))
    return list(pairs[:-n_val]), list(pairs[-n_val:])


def standardize(image: np.ndarray, spatial_ndim: int, nonzero: bool = False) -> np.ndarray:
    """Per-channel z-score; with ``nonzero`` the statistics come from non-zero voxels (skull-stripped MRI)."""
    image = image.astype(np.float32)
    axes = tuple(range(spatial_ndim))
    if nonzero:
        mask = np.any(image != 0, axis=-1, keepdims=True)
        if mask.any():
            count = mask.sum(axis=axes, keepdims=True)
            mean = (image * mask).sum(axis=axes, keepdims=True) / count
            var = (((image - mean) * mask) ** 2).sum(axis=axes, keepdims=True) / count
            return np.where(mask, (image - mean) / (np.sqrt(var) + 1e-6), 0.0).astype(np.float32)
    return ((image - image.mean(axis=axes, keepdims=True)) / (image.std(axis=axes, keepdims=True) + 1e-6)).astype(
        np.float32)


def load_nifti(image_path, label_path):
    """(image (D, H, W, C) float32, label (D, H, W, 1) float32 in {0, 1}) from a NIfTI pair."""
    try:
        import nibabel as nib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("Reading NIfTI volumes needs nibabel: pip install nibabel") from exc
    image = _read_file(image_path, lambda p: np.asarray(nib.load(str(p)).dataobj, dtype=np.float32))
    label = _read_file(label_path, lambda p: np.asarray(nib.load(str(p)).dataobj))
    if image.ndim == 3:
        image = image[..., None]
    if image.ndim != 4 or label.ndim < 3:
        raise ValueError(f"{image_path}: expected a 3D or 4D (channels last) image; got shape {image.shape}.")
    label = label.reshape(label.shape[:3])
    if image.shape[:3] != label.shape:
        raise ValueError(f"{image_path} has shape {image.shape[:3]} but its label has {label.shape}.")
    return standardize(image, 3, nonzero=True), (label > 0).astype(np.float32)[..., None]


class DataFileError(ValueError):
    """A data file that cannot be read; the message names the file."""


def _read_file(path, read):
    """``read(path)``, with a failure turned into one error that names the file (corrupt or truncated data)."""
    try:
        return read(path)
    except (ImportError, DataFileError):
        raise
    except Exception as err:  # every reader fails differently (EOFError, OSError, zlib.error, ...)
        raise DataFileError(f"cannot read {path}: {type(err).__name__}: {err}. The file is damaged or truncated; "
                            "replace it or remove the pair from --data-dir.") from err


def _read_2d(path) -> np.ndarray:
    return _read_file(path, _read_2d_unchecked)


def _read_2d_unchecked(path) -> np.ndarray:
    if path.suffix.lower() in (".tif", ".tiff"):
        try:
            import tifffile
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("Reading TIFF tiles needs tifffile: pip install tifffile") from exc
        return np.asarray(tifffile.imread(str(path)))
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # whole-slide-sized PNGs are the point of this example
    with Image.open(path) as img:
        if img.mode not in ("L", "RGB", "I", "I;16", "F"):
            img = img.convert("RGB")
        return np.asarray(img)


def load_tile(image_path, label_path, channels: int = 3):
    """(image (H, W, channels) float32, label (H, W, 1) float32 in {0, 1}) from a PNG/TIFF pair."""
    image = _read_2d(pathlib.Path(image_path)).astype(np.float32)
    label = _read_2d(pathlib.Path(label_path))
    if image.ndim == 2:
        image = image[..., None]
    if image.shape[-1] != channels:
        if image.shape[-1] == 1:
            image = np.repeat(image, channels, axis=-1)
        elif image.shape[-1] > channels:
            image = image[..., :channels]  # e.g. drop alpha
        else:
            raise ValueError(f"{image_path} has {image.shape[-1]} channels; expected {channels}.")
    if label.ndim == 3:
        label = label.max(axis=-1)
    if image.shape[:2] != label.shape:
        raise ValueError(f"{image_path} is {image.shape[:2]} but its label is {label.shape}.")
    return standardize(image, 2), (label > 0).astype(np.float32)[..., None]


class _FileDataset(_Sharded):
    """Samples from ``pairs`` (this rank's share), cropped/padded to ``shape``; small in-memory cache."""

    def __init__(self, pairs, shape, batch_size=2, steps=None, *, seed=0, split="train", rank=0, size=1,
                 cache=16, foreground_crop=0.5, workers=1, use_multiprocessing=False, max_queue_size=10):
        pairs = list(pairs)
        if not pairs:
            raise ValueError("no image/label pairs given")
        mine = pairs[rank::size] if len(pairs) >= size else [pairs[rank % len(pairs)]]
        if steps is None:
            steps = max(1, (len(pairs) // size) // batch_size)
        super().__init__(batch_size=batch_size, steps=steps, seed=seed, split=split, rank=rank, size=size,
                         workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self.pairs, self.shape = mine, tuple(int(s) for s in shape)
        self.cache_size, self.foreground_crop = int(cache), float(foreground_crop)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def load(self, pair):  # pragma: no cover - abstract
        raise NotImplementedError

    def _loaded(self, k: int):
        with self._lock:  # batches are loaded by parallel threads
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
        item = self.load(self.pairs[k])
        with self._lock:
            if self.cache_size > 0:
                self._cache[k] = item
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return item

    def sample(self, gid: int):
        n = len(self.pairs)
        local = gid // self.size
        rng = _rng(self.seed, SPLITS[self.split], self._epoch_key(), gid, 99)
        order = _rng(self.seed, SPLITS[self.split], self._epoch_key(), local // n, self.rank).permutation(n) \
            if self.split == "train" else np.arange(n)
        image, label = self._loaded(int(order[local % n]))
        spatial = label.shape[:-1]
        fg = np.argwhere(label[..., 0] > 0)
        if self.split == "train":
            if len(fg) and rng.random() < self.foreground_crop:  # centre the crop on a random lesion voxel
                centre = fg[rng.integers(len(fg))]
                start = [int(c) - w // 2 for c, w in zip(centre, self.shape)]
            else:
                start = [int(rng.integers(0, max(1, s - w + 1))) for s, w in zip(spatial, self.shape)]
        elif len(fg):  # validation: centred on the foreground centroid (deterministic)
            start = [int(c) - w // 2 for c, w in zip(fg.mean(axis=0), self.shape)]
        else:
            start = None
        return (crop_or_pad(image, self.shape, start).astype(np.float32),
                crop_or_pad(label, self.shape, start).astype(np.float32))


class NiftiVolumes(_FileDataset):
    """BraTS-like ``*_image.nii.gz`` / ``*_label.nii.gz`` volumes cropped/padded to ``shape`` (a cube)."""

    suffixes = (".nii.gz", ".nii")

    def load(self, pair):
        return load_nifti(*pair)

    @property
    def channels(self) -> int:
        return self._loaded(0)[0].shape[-1]


class ImageTiles(_FileDataset):
    """``*_image.png|tif`` / ``*_label.png|tif`` tiles cropped/padded to ``shape`` (RGB)."""

    suffixes = IMAGE_SUFFIXES
    channels = 3

    def load(self, pair):
        return load_tile(*pair, channels=self.channels)


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
        x, y = dataset[int(index)]
        return x.astype(np.float32, copy=False), y.astype(np.float32, copy=False)

    def batch(index):
        x, y = tf.numpy_function(load, [index], (tf.float32, tf.float32), stateful=True)
        return tf.ensure_shape(x, x_shape), tf.ensure_shape(y, y_shape)

    ds = tf.data.Dataset.range(len(dataset))
    ds = ds.map(batch, num_parallel_calls=max(1, int(parallel_calls)), deterministic=True)
    return ds.prefetch(max(1, int(prefetch)))
