"""The one place that imports `horovod.tensorflow` (and fails with a useful message).

Why a separate module: every other module here imports `hvd` from this one, so a missing or broken Horovod
build produces a single, actionable `ImportError` instead of a raw `NotFoundError` from
`tf.load_op_library` deep inside Horovod.

We only use Horovod's *core* TensorFlow ops (`init`, `size`/`rank`, `grouped_allreduce`,
`allreduce`, `broadcast`, `Compression`); nothing from `horovod.tensorflow.keras` or
`horovod._keras`, which target tf.keras 2 and are broken on Keras 3 (see docs/horovod.md).
"""

from __future__ import annotations

_INSTALL_HINT = (
    "keras_lms.horovod needs Horovod (>= 0.28.1) built with TensorFlow support. "
    "Run `make install` in the keras-lms repository, or "
    "`bash scripts/install_horovod.sh .venv/bin/python` (builds Horovod from source against the installed "
    "TensorFlow; see docs/horovod.md)."
)

try:
    import keras as _keras
except Exception as exc:  # pragma: no cover - keras is a hard dependency of keras_lms
    raise ImportError(f"keras_lms.horovod needs Keras 3: {exc}") from exc

if _keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_lms.horovod supports only the TensorFlow backend (KERAS_BACKEND=tensorflow); "
        f"the active Keras backend is {_keras.backend.backend()!r}."
    )

try:
    import horovod.tensorflow as hvd  # noqa: F401  (re-exported for the sibling modules)
except Exception as exc:  # ImportError, or tf NotFoundError / OSError when mpi_lib.so does not load
    raise ImportError(f"{_INSTALL_HINT} (import horovod.tensorflow failed: {type(exc).__name__}: {exc})") from exc

import tensorflow as tf  # noqa: E402  (after the Horovod check, which imports it anyway)

# Horovod's broadcast/allreduce kernels are registered for these dtypes only
# (horovod/tensorflow/mpi_ops.cc). Others are bit-cast to a same-width supported type for the wire.
_WIRE_DTYPES = {
    tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64,
    tf.float16, tf.float32, tf.float64, tf.bool,
}
_BITCAST = {tf.uint32: tf.int32, tf.uint64: tf.int64, tf.bfloat16: tf.int16}


def to_wire(t: tf.Tensor) -> tf.Tensor:
    """Return `t` in a dtype Horovod can broadcast (bit-exact, reversible with `from_wire`)."""
    if t.dtype in _WIRE_DTYPES:
        return t
    if t.dtype in _BITCAST:
        return tf.bitcast(t, _BITCAST[t.dtype])
    raise TypeError(f"Horovod cannot broadcast tensors of dtype {t.dtype.name}")


def from_wire(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return t if t.dtype == dtype else tf.bitcast(t, dtype)


def in_xla_context() -> bool:
    """True while tracing a function compiled with XLA (`jit_compile=True`).

    Horovod 0.28.1 as built by scripts/install_horovod.sh has no XLA kernels for its collectives (the
    `xla_mpi_ops.cc` file is dropped to compile against TF >= 2.19), so an allreduce inside an XLA
    cluster cannot work; callers use this to fail with a clear message instead of an XLA compile error.
    """
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - private TF helper moved
        return False


XLA_ERROR = (
    "keras_lms.horovod cannot run Horovod collectives inside an XLA-compiled function: Horovod is built "
    "without its XLA ops (see docs/horovod.md). Compile the model with `jit_compile=False` (Keras' default "
    "`jit_compile='auto'` turns XLA on when a GPU is visible), or do not wrap your train step in "
    "`tf.function(jit_compile=True)`."
)
