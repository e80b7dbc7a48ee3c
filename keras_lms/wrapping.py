"""`wrap` and `unwrap`: the entry points that put a model into an `LMSModel` and take it out again."""

from __future__ import annotations

import dataclasses

import keras

from keras_lms.config import LMSConfig
from keras_lms.model import LMSModel

# wrap()'s keyword defaults are LMSConfig's field defaults: the settings have one set of defaults, in config.py.
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(LMSConfig)}


def wrap(model, *, min_bytes=_DEFAULTS["min_bytes"], keep_last=_DEFAULTS["keep_last"], include=_DEFAULTS["include"],
         exclude=_DEFAULTS["exclude"], host_device=_DEFAULTS["host_device"], prefetch=_DEFAULTS["prefetch"],
         device_budget=_DEFAULTS["device_budget"], lean_normalization=_DEFAULTS["lean_normalization"],
         slab_bytes=_DEFAULTS["slab_bytes"], device_profile=_DEFAULTS["device_profile"], config=None) -> LMSModel:
    """Wrap `model` so that training keeps its large activations in host memory.

    During a training step every offloaded layer call copies its inputs to `host_device` in the forward pass;
    its backward pass copies them back and recomputes the call, so the device holds the activations only
    around their own use. The wrapped model computes exactly what `model` computes (the same loss, gradients,
    BatchNorm statistics and Dropout masks); inference (`predict`, `evaluate`, `training=False`) calls `model`
    directly. `wrapped.lms_plan` says for every layer call what is offloaded and why.

    Args:
        model: a built `keras.Model`: Sequential, Functional, nested or subclassed. Its weights are shared
            with the wrapper, not copied.
        min_bytes: layer inputs smaller than this (bytes per training step, or a size string like `"1MiB"`)
            stay on the device; `0` offloads every eligible tensor. Defaults to `1 << 20` (1 MiB).
        keep_last: the last `keep_last` layer calls of the forward pass keep their inputs on the device (their
            backward runs first). `0` keeps none. Defaults to `1`.
        include: only these layers may be offloaded: layer names (or a nested model's name), layer classes,
            or predicates `layer -> bool`. `None` (the default) considers every layer.
        exclude: these layers are never offloaded (same forms as `include`; wins over it). Defaults to `None`.
        host_device: the CPU device that holds offloaded tensors. Defaults to `"/CPU:0"`.
        prefetch: the copy back starts `prefetch` layer calls ahead in the backward pass (`0`: when the
            layer's gradient arrives). Defaults to `1`.
        device_budget: `None`, or bytes / a size string such as `"6GiB"`: offload only what the predicted
            training step needs to fit the budget (largest, longest-lived tensors first; nothing when it fits
            anyway). Defaults to `None`.
        lean_normalization: torch back end: differentiate offloaded BatchNormalization calls from the forward's
            batch statistics, slab by slab, without recomputing them (see `LMSConfig`); `False` recomputes.
            On TensorFlow `slab_bytes` does this job. Defaults to `True`.
        slab_bytes: offloaded calls of spatially local layers (stride-1 "same" convolutions, BatchNormalization,
            element-wise activations) whose input is larger than this run in slabs along the first spatial axis,
            forward and backward, so only slab-sized temporaries exist on the device (see `LMSConfig`). `0`
            turns slabs off. Defaults to `256 << 20` (256 MiB).
        device_profile: `None`, a built-in device profile's name (`"h100-pcie5"`, `"gh200"`, ...), a profile
            file from `keras-lms calibrate` or a `keras_lms.DeviceProfile`: the planner then recomputes, instead
            of copying, each tensor whose recompute the predicted step on that device says is faster (TensorFlow:
            windows of slab-computed calls; torch: a BatchNorm's output, or its activation's), and with
            `device_budget` picks the slab size with the shortest predicted step among those that fit (see
            `LMSConfig`). Defaults to `None`.
        config: a `keras_lms.LMSConfig` to use instead of the keyword settings above (pass one or the other).

    Returns:
        A `keras_lms.LMSModel` (a `keras.Model`): `compile`, `fit`, `evaluate`, `predict` and `save` work as
        usual (`jit_compile=True` is refused: XLA ignores host placement).

    Raises:
        TypeError: `model` is not a `keras.Model`, `config` is not an `LMSConfig`, or a setting has the wrong
            type (see `LMSConfig`).
        ValueError: `model` is not built, is already wrapped or contains a wrapped model; `config` is given
            together with keyword settings; a setting has an impossible value or names a layer the model does
            not have; `host_device` is not an existing CPU device.
        keras_lms.BudgetError: `device_budget` cannot be met even with every eligible tensor offloaded (the
            message names the largest layer call).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms

    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
    wrapped = keras_lms.wrap(model, min_bytes="16KiB")
    wrapped.compile(optimizer="adam", loss="mse")
    wrapped.fit(np.zeros((8, 32, 32, 3)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
    for entry in wrapped.lms_plan:
        print(entry)
    assert keras_lms.unwrap(wrapped) is model
    ```
    """
    # The model itself is checked by LMSModel's constructor (also for `LMSModel(model, config)` and loading).
    given = dict(min_bytes=min_bytes, keep_last=keep_last, include=include, exclude=exclude,
                 host_device=host_device, prefetch=prefetch, device_budget=device_budget,
                 lean_normalization=lean_normalization, slab_bytes=slab_bytes, device_profile=device_profile)
    if config is not None:
        changed = sorted(k for k, v in given.items() if v != _DEFAULTS[k])
        if changed:
            raise ValueError(f"Pass either config= or keyword settings, not both (got config and {changed}).")
    else:
        config = LMSConfig(**given)
    return LMSModel(model, config)


def unwrap(wrapped) -> keras.Model:
    """The original model of a wrapped one.

    Args:
        wrapped: a model returned by `keras_lms.wrap` (or loaded from a file it saved).

    Returns:
        The `keras.Model` that was wrapped: the same object, so its weights are the trained ones.

    Raises:
        TypeError: `wrapped` is not a `keras_lms.LMSModel`.

    Example:

    ```python
    import keras
    import keras_lms

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert keras_lms.unwrap(keras_lms.wrap(model)) is model
    ```
    """
    if not isinstance(wrapped, LMSModel):
        raise TypeError(f"keras_lms.unwrap expects a model returned by keras_lms.wrap; got {type(wrapped).__name__}.")
    return wrapped.inner_model
