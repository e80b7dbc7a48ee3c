"""The Keras range keras-lms supports, and the Keras helpers it needs that public API provides.

Kept out of :mod:`keras_lms._keras_adapter`, which holds only what needs private Keras API; the adapter
re-exports these names, so ``adapter.check_keras_version`` and friends keep working.
"""

from __future__ import annotations

import contextlib

import keras

# The Keras range keras_lms/_keras_adapter/ was written for (pyproject.toml pins the same range).
SUPPORTED_KERAS = (">=3.15", "<3.16")


def check_keras_version(version: str | None = None) -> None:
    """Raise ImportError when the installed Keras is outside the range this adapter was written for."""
    version = version or keras.__version__
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as err:  # pragma: no cover - exotic version strings
        raise ImportError(f"keras-lms cannot parse the Keras version {version!r}") from err
    if (major, minor) != (3, 15):
        raise ImportError(
            f"keras-lms supports Keras {SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} but Keras {version} is installed. "
            "Install a supported Keras (pip install 'keras>=3.15,<3.16') or a keras-lms release for your Keras."
        )


def is_quantized(layer) -> bool:
    """Quantized layers run ``quantized_call``, which our interception does not see."""
    return getattr(layer, "quantization_mode", None) is not None


@contextlib.contextmanager
def patched_attribute(obj, name: str, value):
    """Shadow ``obj.name`` with ``value`` on the instance for the duration of the block."""
    had_own = name in obj.__dict__
    previous = obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(obj, name, previous)
        else:
            object.__delattr__(obj, name)
