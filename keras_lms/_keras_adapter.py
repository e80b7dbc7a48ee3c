"""The only module that touches private Keras API.

keras-lms needs four things Keras 3 does not expose publicly:

* run a layer's *original* ``call`` statelessly while collecting only the losses that ``call`` adds
  (``Layer.stateless_call(return_losses=True)`` also returns weight-regularisation losses, which Keras
  adds again from ``model.losses``; counting them twice would change the loss);
* read a variable's stored value without the mixed-precision autocast that is active inside a layer call;
* intercept a layer call *after* ``Layer.__call__`` has resolved ``training``, masks and autocasting,
  which we do by shadowing the bound ``call`` method on the instance for the duration of one forward pass;
* clear the losses a throw-away planning trace left on the layers.

Everything here is pinned to the Keras range in pyproject.toml; ``tests/test_keras_adapter.py`` fails
loudly when a Keras release changes one of these assumptions.
"""

from __future__ import annotations

import contextlib

import keras
from keras.src.backend.common import global_state  # noqa: F401  (import checked by the adapter test)
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope
from keras.src.backend.common.variables import AutocastScope

SUPPORTED_KERAS = (">=3.15", "<3.16")

__all__ = [
    "SUPPORTED_KERAS",
    "check_keras_version",
    "run_stateless",
    "raw_values",
    "patched_calls",
    "original_call",
    "clear_losses",
    "is_quantized",
    "functional_operations",
]


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


def current_autocast_dtype():
    """The mixed-precision autocast dtype ``Layer.__call__`` set for the call in progress (None: no cast)."""
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def run_stateless(layer, call_fn, trainable_values, non_trainable_values, args, kwargs, autocast_dtype=None):
    """Run ``call_fn(*args, **kwargs)`` for ``layer`` with its variables mapped to the given values.

    Returns ``(outputs, new_non_trainable_values, call_losses)``; nothing is assigned. This is
    ``Layer.stateless_call`` minus weight-regularisation losses, and it takes the unpatched ``call``.
    Operations that are not layers (``keras.ops`` nodes of a functional graph) have no variables.
    ``autocast_dtype`` re-creates the autocast scope of the original call, so a recompute outside
    ``Layer.__call__`` casts variables exactly as the forward pass did.
    """
    trainable_vars = list(getattr(layer, "trainable_variables", []))
    non_trainable_vars = list(getattr(layer, "non_trainable_variables", []))
    mapping = list(zip(trainable_vars, trainable_values)) + list(zip(non_trainable_vars, non_trainable_values))
    with AutocastScope(autocast_dtype), StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        outputs = call_fn(*args, **kwargs)
    new_values = [scope.get_current_value(v) for v in non_trainable_vars]
    return outputs, new_values, list(scope.losses)


def raw_values(variables):
    """Current values of ``variables`` in their storage dtype (no mixed-precision autocast).

    Inside an outer StatelessScope (e.g. someone calls ``stateless_call`` on the wrapped model) the
    scope's values are the current ones.
    """
    scope = get_stateless_scope()
    values = []
    with AutocastScope(None):
        for v in variables:
            value = scope.get_current_value(v) if scope is not None else None
            values.append(v.value if value is None else value)
    return values


def original_call(op):
    """The bound ``call`` that ``Operation.__call__`` would run for ``op`` (ignoring our patch)."""
    own = op.__dict__.get("_keras_lms_original_call")
    if own is not None:
        return own
    return op.call


@contextlib.contextmanager
def patched_calls(ops, make_wrapper):
    """Shadow ``op.call`` with ``make_wrapper(op, original)`` for every op, restoring on exit.

    ``Layer.__call__`` / ``Operation.__call__`` look ``call`` up on the instance, so an instance attribute
    intercepts every call of that op after Keras resolved ``training``, masks and autocast scopes.
    """
    patched = []
    try:
        for op in ops:
            if "_keras_lms_original_call" in op.__dict__:
                raise RuntimeError(
                    f"Layer {op.name!r} is already being intercepted by keras-lms (nested wrapped models sharing "
                    "layers are not supported). Wrap only the outermost model."
                )
            had_own = "call" in op.__dict__
            previous = op.__dict__.get("call")
            original = op.call
            object.__setattr__(op, "_keras_lms_original_call", original)
            object.__setattr__(op, "call", make_wrapper(op, original))
            patched.append((op, had_own, previous))
        yield
    finally:
        for op, had_own, previous in reversed(patched):
            if had_own:
                object.__setattr__(op, "call", previous)
            else:
                object.__delattr__(op, "call")
            object.__delattr__(op, "_keras_lms_original_call")


def clear_losses(layer) -> None:
    """Drop losses that ``add_loss`` left on ``layer`` and its sublayers (e.g. from a planning trace)."""
    layer._clear_losses()


def is_quantized(layer) -> bool:
    """Quantized layers run ``quantized_call``, which our interception does not see."""
    return getattr(layer, "quantization_mode", None) is not None


def functional_operations(model):
    """All operations of a functional graph (layers and ``keras.ops`` nodes), without InputLayers."""
    ops = getattr(model, "_operations", None)
    if ops is None:
        return None
    return [op for op in ops if not isinstance(op, keras.layers.InputLayer)]


def get_mask(x):
    """The Keras mask attached to a tensor, or None."""
    from keras.src.backend.common.masking import get_keras_mask

    try:
        return get_keras_mask(x)
    except AttributeError:  # pragma: no cover - tensors that cannot carry attributes
        return None


def set_mask(x, mask) -> None:
    """Attach a Keras mask to a tensor (what ``Layer.__call__`` does for layers that support masking)."""
    from keras.src.backend.common.masking import set_keras_mask

    if mask is not None:
        set_keras_mask(x, mask)


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


def batchnorm_moments_hook(layer):
    """Name of the BatchNormalization method that computes batch statistics, when it can be hooked.

    Keras' BatchNormalization.call gets (mean, variance) from ``self._moments(inputs, mask)``; renorm and
    synchronized BatchNorm do more than that, so they are not hooked.
    """
    import keras

    if (type(layer).call is keras.layers.BatchNormalization.call and not getattr(layer, "renorm", False)
            and not getattr(layer, "synchronized", False) and hasattr(layer, "_moments")):
        return "_moments"
    return None
