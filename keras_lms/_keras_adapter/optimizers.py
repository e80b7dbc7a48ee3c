"""Optimizer internals, for ``keras_lms.horovod``: key, list and save an optimizer's variables as Keras does.

Keras internals relied on (Keras 3.15), and why:

* ``Optimizer._var_key``: the Horovod optimizer keys its own per-variable state as Keras does, so a
  ``keras.Variable`` and the backend variable it wraps are one variable;
* ``BaseOptimizer._trainable_variables``: the variables a built optimizer was built with, which ``apply(grads)``
  without variables applies to (Horovod must know which gradient is whose);
* ``RMSprop._momentums``: the Horovod learning-rate callbacks rescale momentum buffers, and RMSprop's (unlike
  SGD's ``momentums``) are private;
* ``keras.src.api_export.REGISTERED_OBJS_TO_NAMES`` and ``get_name_from_symbol``: the registry
  ``serialize_keras_object`` names a class by (its ``keras.*`` export), which has no public writer; a model
  saved with ``DistributedOptimizer`` must load without keras-lms or Horovod, as the plain optimizer.

A private attribute that is gone raises :class:`RuntimeError` naming the adapter function and the Keras versions.
"""

from __future__ import annotations

import keras

from keras_lms._keras_support import SUPPORTED_KERAS


def _private(obj, name: str, function: str):
    """``obj.<name>``, a private Keras attribute ``function`` relies on; a clear error when Keras dropped it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(
            f"keras_lms._keras_adapter.{function}() relies on {type(obj).__name__}.{name}, private API of Keras "
            f"{SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} that Keras {keras.__version__} does not have. The adapter "
            "needs updating for this Keras (tests/test_keras_adapter.py names each assumption)."
        ) from None


def optimizer_variable_key(optimizer, variable):
    """The key ``optimizer`` indexes ``variable``'s state by (``Optimizer._var_key``, Keras 3.15).

    Why: the Horovod optimizer keys its own per-variable state (local-gradient registrations, accumulators,
    allreduce groups) as Keras does, so that a ``keras.Variable`` and the backend variable it wraps are one
    variable (on TensorFlow the key is the ``tf.Variable``'s unique id).
    """
    return _private(optimizer, "_var_key", "optimizer_variable_key")(variable)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a built ``optimizer`` was built with (``BaseOptimizer._trainable_variables``, Keras 3.15).

    Why: ``apply(grads)`` without variables applies to these (Horovod must know which gradient is whose), and
    wrapping a built optimizer builds the copy on the same list; Keras has no public accessor.
    """
    return list(_private(optimizer, "_trainable_variables", "optimizer_trainable_variables"))


def rmsprop_momentums(optimizer) -> list:
    """A built ``keras.optimizers.RMSprop``'s momentum buffers (``RMSprop._momentums``, Keras 3.15).

    Why: the Horovod learning-rate callbacks rescale momentum buffers when the rate changes; SGD's are public
    (``SGD.momentums``), RMSprop's are not. Empty when ``momentum`` is 0.
    """
    return list(_private(optimizer, "_momentums", "rmsprop_momentums"))


def serialize_like(cls: type, base: type) -> None:
    """Make Keras serialise instances of ``cls`` (a subclass of ``base``) exactly as instances of ``base``.

    Why: ``keras_lms.horovod.DistributedOptimizer`` returns an instance of a subclass made on the fly, and a
    model saved with it must load without keras-lms or Horovod, as the plain optimizer. Keras 3.15's
    ``serialize_keras_object`` names a class by its ``keras.*`` export, held in the private registry
    ``keras.src.api_export.REGISTERED_OBJS_TO_NAMES`` (no public writer), else by its registered custom name,
    which the public ``keras.saving.register_keras_serializable`` writes.
    """
    from keras.src import api_export

    exported = _private(api_export, "REGISTERED_OBJS_TO_NAMES", "serialize_like")
    public = api_export.get_name_from_symbol(base)
    if public is not None:
        exported[cls] = public
    name = keras.saving.get_registered_name(base)
    if name != base.__name__:  # ``base`` is registered as "package>name"
        package, _, short = name.partition(">")
        keras.saving.register_keras_serializable(package, short)(cls)
        keras.saving.register_keras_serializable(package, short)(base)  # the name still deserialises ``base``
