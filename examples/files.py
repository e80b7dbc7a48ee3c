"""Real data from a folder: find ``*_image`` / ``*_label`` pairs, read them, crop/pad them to the model's input.

* :class:`NiftiVolumes` -- ``*_image.nii.gz`` / ``*_label.nii.gz`` pairs (BraTS-like; 3D or 4D images, the 4th
  axis is channels), cropped/padded to a cube. Labels > 0 are foreground (e.g. BraTS "whole tumour").
* :class:`ImageTiles` -- ``*_image.{png,tif,tiff}`` / ``*_label.{png,tif,tiff}`` pairs (satellite/pathology
  tiles), read with Pillow or tifffile, converted to RGB, cropped/padded to a square.

Both are sharded PyDatasets (:mod:`examples.sharded`) split file-wise between ranks (``files[rank::size]``),
with a small in-memory cache; training crops are drawn afresh every epoch (deterministic given ``seed``),
validation crops are fixed. A file that cannot be read raises :class:`DataFileError`, naming the file.
"""

from __future__ import annotations

import pathlib
import threading
from collections import OrderedDict

import numpy as np

if __package__:  # imported as examples.files (python -m examples.segmentation_3d, the tests)
    from .sharded import SPLITS, _rng, _Sharded
else:  # python examples/segmentation_3d.py: examples/ is on sys.path
    from sharded import SPLITS, _rng, _Sharded

IMAGE_SUFFIXES = (".png", ".tif", ".tiff")


# ------------------------------------------------------------------------------------------------ loading
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


# ----------------------------------------------------------------------------------------------- datasets
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

