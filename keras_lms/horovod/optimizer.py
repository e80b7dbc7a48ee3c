"""`DistributedOptimizer`: average gradients across ranks inside `Optimizer.apply`.

Why not `horovod.tensorflow.keras.DistributedOptimizer`: it was written for tf.keras 2, where `fit` called
`optimizer.get_gradients`/`_compute_gradients` and Horovod averaged there. Keras 3's `train_step` computes
gradients with its own `GradientTape` and calls `optimizer.apply_gradients` -> `optimizer.apply` directly,
so Horovod's hook never runs and every rank silently trains on its own gradients.

Where and how gradients are averaged (inside `Optimizer.apply`, before clipping and weight decay): see
`averaging.py`. This module builds the optimizer: it checks the settings, creates the wrapper and copies state.

How the wrapper is made: like Horovod, a subclass of the optimizer's own class is created on the fly and
instantiated from `optimizer.get_config()`. `isinstance(opt, keras.optimizers.SGD)` stays true,
`get_config()` is the inner optimizer's config, and saving serialises it under the inner class' public name
(`keras.optimizers.SGD`), so a saved model loads without Horovod (as a plain optimizer; use
`load_model` to load and re-wrap in one step).
"""

from __future__ import annotations

import keras

from .. import _keras_adapter as adapter
from ._hvd import hvd
from .averaging import ALLREDUCE_NAME, _DistributedMixin, _Settings, distributed_class

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSION = {None: hvd.Compression.none, "none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def _resolve(table: dict, value, what: str):
    if isinstance(value, str):
        value = value.lower()
    if value in table:
        return table[value]
    if value in table.values():
        return value
    raise ValueError(f"{what} must be one of {sorted(k for k in table if k)}; got {value!r}")


_ITERATIONS = ("per_pass", "per_update")


def _check_groups(groups, num_groups):
    if num_groups:
        if groups is not None:
            raise ValueError("pass either `groups` or the deprecated `num_groups`, not both")
        groups = num_groups
    if groups is None or groups == 0:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"groups should be a positive integer or a list of lists of variables; got {groups!r}")
    if isinstance(groups, list):
        return tuple(tuple(g) for g in groups)
    return int(groups)


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op="average",
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups=None,
    process_set=hvd.global_process_set,
    scale_local_gradients: bool = True,
    *,
    iterations: str = "per_pass",
):
    """Return a copy of `optimizer` that averages gradients across Horovod ranks before applying them.

    The arguments, their order and defaults are those of Horovod 0.28.1's
    `horovod.tensorflow.keras.DistributedOptimizer`, so a Horovod script runs unchanged; `iterations` is ours
    (keyword only). The returned optimizer is an instance of a subclass of `optimizer`'s class created on the
    fly (`isinstance(opt, keras.optimizers.SGD)` stays true); it allreduces inside `Optimizer.apply`, the one
    entry every Keras 3 update goes through (in `fit` and in custom loops), before clipping and weight decay.
    With one rank the allreduce is skipped and everything else behaves the same. A model saved with it loads
    without Horovod, as the plain optimizer (`keras_lms.horovod.load_model` loads and re-wraps).

    Args:
        optimizer: a Keras 3 optimizer instance (or anything `keras.optimizers.get` accepts). It is not
            modified; a new optimizer is built from `optimizer.get_config()`. If `optimizer` is already built
            its variables (slots, iterations) are copied, so wrapping a loaded, trained optimizer keeps its
            state.
        name: the name of the gradient collective (default `"keras_lms_gradients"`); must be the same on every
            rank. Horovod uses it as an op-name prefix. A non-string is refused (before 0.2 the second
            positional argument was `backward_passes_per_step`).
        device_dense: the device for Horovod's dense collectives (`""`: Horovod's choice).
        device_sparse: the device for Horovod's sparse collectives (`""`: Horovod's choice).
        compression: `None`/`"none"` or `"fp16"` (cast float gradients to float16 on the wire), or a
            `Compression` class (`keras_lms.horovod.Compression.fp16`). Defaults to `None`.
        sparse_as_dense: convert `tf.IndexedSlices` gradients (e.g. from `Embedding`) to dense tensors before
            the allreduce. Otherwise they are allgathered (cheaper for small, sparse updates). Defaults to
            `False`.
        gradient_predivide_factor: with `op=Average`, scale by `1/f` before the sum and `f/size` after.
            Defaults to `1.0`.
        op: `Average` (default) or `Sum` (or `Adasum`, MPI builds only), or `"average"` / `"sum"`.
        backward_passes_per_step: N > 1 accumulates gradients locally for N calls of `apply` and only then
            allreduces and applies once (N times fewer collectives). Defaults to `1`.
        average_aggregated_gradients: with N > 1, divide the local sum by N (the mean over the N micro-batches,
            what Keras' own `gradient_accumulation_steps` does). `False` (Horovod's default) applies the sum.
        num_groups: deprecated alias of `groups` (as in Horovod). Defaults to `0`.
        groups: an int: split the gradients into that many grouped allreduces; a list of lists of variables:
            one grouped allreduce per list, every other gradient alone. `None` (default): one grouped allreduce.
        process_set: reduce over this `ProcessSet` only (see `init(process_sets=...)`). Defaults to all ranks.
        scale_local_gradients: divide the gradients of variables registered with `register_local_var` (or
            `PartialDistributedOptimizer`'s `local_layers`) by the process-set size, as Horovod does. Defaults
            to `True`.
        iterations: with N > 1, what `optimizer.iterations` counts: `"per_pass"` (default; every call of
            `apply`, as Horovod and Keras' `gradient_accumulation_steps` count, so `LearningRateSchedule`s and
            callbacks that read `iterations` advance per micro-batch) or `"per_update"` (applied updates only).

    Returns:
        The distributed optimizer: pass it to `model.compile(optimizer=...)`.

    Raises:
        TypeError: `name` is not a str, `backward_passes_per_step` is not an int, `process_set` is not a
            `ProcessSet`, or `optimizer` is not a Keras 3 optimizer.
        ValueError: `optimizer` is already distributed, or a setting has an impossible value
            (`backward_passes_per_step < 1`, an unknown `op`, `compression` or `iterations`,
            `gradient_predivide_factor <= 0` or with `op=Sum`).
        RuntimeError: (in a training step) the step is compiled with XLA (`jit_compile=True`): Horovod is
            built without XLA ops.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms
    import keras_lms.horovod as lhvd

    lhvd.init()
    model = keras_lms.wrap(keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                             keras.layers.Dense(1)]))
    opt = lhvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * lhvd.size()))
    assert isinstance(opt, keras.optimizers.SGD)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(np.zeros((8, 8)), np.zeros((8, 1)), batch_size=4, verbose=0,
              callbacks=[lhvd.BroadcastGlobalVariablesCallback(0)])
    ```
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"DistributedOptimizer's second argument is `name` (a str), as in Horovod; got {name!r}. "
            "Pass the number of micro-batches by keyword: backward_passes_per_step=..."
        )
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("optimizer is already a keras_lms.horovod.DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"expected a Keras 3 optimizer (keras.optimizers.Optimizer), got {type(optimizer).__name__}; "
            "tf.keras / legacy optimizers are not supported"
        )
    if isinstance(backward_passes_per_step, bool) or int(backward_passes_per_step) != backward_passes_per_step:
        raise TypeError(f"backward_passes_per_step must be an integer, got {backward_passes_per_step!r}")
    n = int(backward_passes_per_step)
    if n < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if n > 1 and getattr(inner, "gradient_accumulation_steps", None):
        raise ValueError(
            f"the optimizer already accumulates gradients (gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}) and backward_passes_per_step={n} would accumulate again. "
            "Use one: backward_passes_per_step (N times fewer allreduces) or Keras' gradient_accumulation_steps."
        )
    if iterations not in _ITERATIONS:
        raise ValueError(f"iterations must be one of {_ITERATIONS}; got {iterations!r}")
    op = _resolve(_OPS, op, "op")
    if float(gradient_predivide_factor) != 1.0 and op is not hvd.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
    if float(gradient_predivide_factor) <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if not isinstance(process_set, hvd.ProcessSet):
        raise TypeError(f"process_set must be a keras_lms.horovod.ProcessSet, got {type(process_set).__name__}")
    settings = _Settings(
        name=name or ALLREDUCE_NAME,
        device_dense=device_dense or "",
        device_sparse=device_sparse or "",
        compression=_resolve(_COMPRESSION, compression, "compression"),
        sparse_as_dense=bool(sparse_as_dense),
        gradient_predivide_factor=float(gradient_predivide_factor),
        op=op,
        backward_passes_per_step=n,
        average_aggregated_gradients=bool(average_aggregated_gradients),
        groups=_check_groups(groups, num_groups),
        process_set=process_set,
        scale_local_gradients=bool(scale_local_gradients),
        iterations=iterations,
    )
    cls = distributed_class(type(optimizer))
    new = cls.from_config(optimizer.get_config())
    object.__setattr__(new, "_hvd_settings", settings)
    if optimizer.built:
        new.build(adapter.optimizer_trainable_variables(optimizer))
        new.built = True
        if len(new.variables) != len(optimizer.variables):  # pragma: no cover - defensive
            raise RuntimeError("could not copy the state of the built optimizer")
        for dst, src in zip(new.variables, optimizer.variables):
            dst.assign(src)
    return new


def PartialDistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op="average",
    groups=None,
    process_set=hvd.global_process_set,
    local_layers=None,
    scale_local_gradients: bool = True,
):
    """A `DistributedOptimizer` whose `local_layers`' trainable weights keep their local gradients.

    Horovod's `PartialDistributedOptimizer` (same arguments and order): every trainable weight of
    `local_layers` (a layer or a list of layers) is registered with `register_local_var`, so its
    gradient is not allreduced (and, with `scale_local_gradients`, divided by the number of ranks). Build
    the layers first: their weights must exist.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be keras.layers.Layer instances.")
    unbuilt = [layer.name for layer in local_layers if not layer.built]
    if unbuilt:
        raise ValueError(f"local_layers {unbuilt} are not built yet, so their weights do not exist; build the model "
                         "first (e.g. call it on an input or create it with keras.Input).")
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                               compression=compression, sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
                               process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def is_distributed(optimizer) -> bool:
    """True if `optimizer` was made by `DistributedOptimizer`."""
    return isinstance(optimizer, _DistributedMixin)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None, legacy_opts=False, *,
               compile=True, safe_mode=True, **distributed_kwargs):
    """`keras.saving.load_model` and, if the model was compiled, wrap its optimizer (state preserved).

    Horovod's signature and order: `custom_optimizers` is a list of optimizer classes the file may use
    (they are added to `custom_objects` and the loaded optimizer is wrapped like any other);
    `compression` is passed to `DistributedOptimizer`, as are `distributed_kwargs`.
    A model saved with a `DistributedOptimizer` stores the plain inner optimizer, so it loads anywhere;
    this helper restores the distributed behaviour for resumed multi-rank training.
    """
    if isinstance(custom_optimizers, dict):
        raise TypeError(
            "load_model's second argument is `custom_optimizers`, a list of optimizer classes, as in Horovod; "
            "got a dict. Pass custom objects by keyword: load_model(path, custom_objects={...})."
        )
    if legacy_opts:
        raise ValueError("legacy_opts=True: Keras 3 has no legacy (tf.keras 2) optimizers.")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
            raise TypeError(f"custom_optimizers must hold keras.optimizers.Optimizer subclasses; got {cls!r}")
        objects.setdefault(cls.__name__, cls)
    model = keras.saving.load_model(filepath, custom_objects=objects or None, compile=compile,
                                    safe_mode=safe_mode)
    if compile and getattr(model, "optimizer", None) is not None and not is_distributed(model.optimizer):
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression, **distributed_kwargs)
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(model, attr):
                setattr(model, attr, None)
    return model
