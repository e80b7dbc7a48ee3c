"""``DistributedOptimizer``: average gradients across ranks inside ``Optimizer.apply``.

Why not ``horovod.tensorflow.keras.DistributedOptimizer``: it was written for tf.keras 2, where ``fit`` called
``optimizer.get_gradients``/``_compute_gradients`` and Horovod averaged there. Keras 3's ``train_step`` computes
gradients with its own ``GradientTape`` and calls ``optimizer.apply_gradients`` -> ``optimizer.apply`` directly,
so Horovod's hook never runs and every rank silently trains on its own gradients.

Where we hook, and why it cannot be skipped (Keras 3.15, ``keras/src/optimizers/base_optimizer.py``):
``apply_gradients(grads_and_vars)`` only unzips and calls ``self.apply(grads, vars)``; ``apply`` builds the
optimizer if needed, filters ``None`` gradients, unscales (``loss_scale_factor``) and calls
``_backend_apply_gradients`` (Keras' own gradient accumulation, clipping, weight decay, ``update_step``, EMA).
``LossScaleOptimizer`` forwards to ``inner_optimizer.apply``; the TensorFlow backend's ``stateless_apply``
raises. So ``apply`` is the single public entry every update goes through, in ``fit`` and in custom loops; we
override it and allreduce *before* calling the original, i.e. before clipping/weight decay, so clipping sees
the averaged gradient exactly as single-process large-batch training would.

How the wrapper is made: like Horovod, a subclass of the optimizer's own class is created on the fly and
instantiated from ``optimizer.get_config()``. ``isinstance(opt, keras.optimizers.SGD)`` stays true,
``get_config()`` is the inner optimizer's config, and saving serialises it under the inner class' public name
(``keras.optimizers.SGD``), so a saved model loads without Horovod (as a plain optimizer; use
:func:`load_model` to load and re-wrap in one step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from ._hvd import XLA_ERROR, hvd, in_xla_context, tf

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSION = {None: hvd.Compression.none, "none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
# The gradient collective's name, the same on every rank (see _hvd_allreduce).
ALLREDUCE_NAME = "keras_lms_gradients"


@dataclasses.dataclass(frozen=True)
class _Settings:
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = True
    compression: Any = hvd.Compression.none
    sparse_as_dense: bool = False
    op: Any = hvd.Average


class _DistributedMixin:
    """Methods mixed in front of the inner optimizer's class (see module docstring)."""

    # Class default, so ``from_config``/cloning of the dynamic class still gives a working distributed optimizer.
    _hvd_settings = _Settings()
    _hvd_accumulators = None
    _hvd_counter = None

    # ------------------------------------------------------------------ build: local aggregation buffers
    def build(self, variables):
        super().build(variables)
        if self._hvd_settings.backward_passes_per_step > 1 and self._hvd_accumulators is None:
            self._hvd_make_accumulators(list(variables))

    def _hvd_make_accumulators(self, variables):
        # Plain tf.Variables set with object.__setattr__: not tracked by Keras, so optimizer.variables,
        # get_weights/set_weights and saved files are identical to those of the inner optimizer.
        accs, index = [], {}
        with tf.init_scope():
            for i, v in enumerate(variables):
                tv = v.value if isinstance(v, keras.Variable) else v
                with tf.device(tv.device):
                    accs.append(tf.Variable(tf.zeros(tv.shape, tv.dtype), trainable=False,
                                            name=f"hvd_accumulator_{i}"))
                index[self._var_key(v)] = i
            counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_local_step")
        object.__setattr__(self, "_hvd_accumulators", accs)
        object.__setattr__(self, "_hvd_acc_index", index)
        object.__setattr__(self, "_hvd_vars", list(variables))
        object.__setattr__(self, "_hvd_counter", counter)

    # ------------------------------------------------------------------------------------------ apply
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._hvd_settings.backward_passes_per_step == 1:
            return super().apply(self._hvd_allreduce(grads), trainable_variables)
        return self._hvd_aggregate_and_apply(grads, trainable_variables)

    def _hvd_aggregate_and_apply(self, grads, trainable_variables):
        """Accumulate locally; every N-th call allreduce the sum (or mean) and apply it once."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already be built. "
                    "Call `optimizer.build(trainable_variables)` first."
                )
            variables = list(self._hvd_vars)
        else:
            variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(variables)
                self.built = True
        if self._hvd_accumulators is None:  # built before wrapping / by a subclass that skipped our build
            self._hvd_make_accumulators(variables)
        n = self._hvd_settings.backward_passes_per_step
        accs = [self._hvd_accumulators[self._hvd_acc_index[self._var_key(v)]] for v in variables]
        for g, acc in zip(grads, accs):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                acc.scatter_add(tf.IndexedSlices(tf.cast(g.values, acc.dtype), g.indices, g.dense_shape))
            else:
                acc.assign_add(tf.cast(g, acc.dtype))
        step = self._hvd_counter.assign_add(1)
        present = [g is not None for g in grads]
        parent_apply = super().apply  # zero-argument super() does not work inside the closure below
        scale = 1.0 / n if self._hvd_settings.average_aggregated_gradients else 1.0

        def _apply_aggregated():
            agg = [acc.read_value() * scale if p else None for acc, p in zip(accs, present)]
            parent_apply(self._hvd_allreduce(agg), variables)
            for acc in accs:
                acc.assign(tf.zeros_like(acc))

        # Every rank has the same counter, so all take the same branch and the collective cannot hang.
        tf.cond(tf.equal(step % n, 0), _apply_aggregated, lambda: None)

    # -------------------------------------------------------------------------------------- allreduce
    def _hvd_allreduce(self, grads):
        """One grouped allreduce over all non-None gradients (identity when there is one rank)."""
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx or hvd.size() == 1:
            return grads
        if in_xla_context():
            raise RuntimeError(XLA_ERROR)
        st = self._hvd_settings
        tensors = []
        for i in idx:
            g = grads[i]
            if isinstance(g, tf.IndexedSlices):
                if st.sparse_as_dense:
                    g = tf.convert_to_tensor(g)
            elif not tf.is_tensor(g):
                g = tf.convert_to_tensor(g)
            tensors.append(g)
        # IndexedSlices (sparse_as_dense=False) are allgathered by grouped_allreduce: values are divided by
        # size for Average, and duplicate indices are summed when the optimizer scatter-adds them.
        # A fixed name: unnamed, Horovod names the collective after the gradient tensors, whose names embed
        # Keras' per-process layer-name counters; ranks that built different layers would never match (hang).
        reduced = hvd.grouped_allreduce(tensors, op=st.op, compression=st.compression,
                                        name=ALLREDUCE_NAME, ignore_name_scope=True)
        out = list(grads)
        for i, r in zip(idx, reduced):
            out[i] = r
        return out


_CLASS_CACHE: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    cls = _CLASS_CACHE.get(base)
    if cls is not None:
        return cls
    cls = type(
        base.__name__,
        (_DistributedMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__},
    )
    # Serialise exactly like the inner class (saving a model must not require keras_lms/Horovod to load it).
    try:
        from keras.src import api_export

        public = api_export.get_name_from_symbol(base)
        if public is not None:
            api_export.REGISTERED_OBJS_TO_NAMES[cls] = public
    except Exception:  # pragma: no cover - private Keras module moved; falls back to module/class name
        pass
    try:
        from keras.src.saving import object_registration

        if base in object_registration.GLOBAL_CUSTOM_NAMES:
            object_registration.GLOBAL_CUSTOM_NAMES[cls] = object_registration.GLOBAL_CUSTOM_NAMES[base]
    except Exception:  # pragma: no cover
        pass
    _CLASS_CACHE[base] = cls
    return cls


def _resolve(table: dict, value, what: str):
    if isinstance(value, str):
        value = value.lower()
    if value in table:
        return table[value]
    if value in table.values():
        return value
    raise ValueError(f"{what} must be one of {sorted(k for k in table if k)}; got {value!r}")


def DistributedOptimizer(
    optimizer,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = True,
    compression=None,
    sparse_as_dense: bool = False,
    op="average",
):
    """Return a copy of ``optimizer`` that allreduces gradients across Horovod ranks before applying them.

    Args:
        optimizer: a Keras 3 optimizer instance (or anything ``keras.optimizers.get`` accepts). It is not
            modified; a new optimizer of a dynamically created subclass of its class is returned, built from
            ``optimizer.get_config()``. If ``optimizer`` is already built its variables (slots, iterations)
            are copied, so wrapping a loaded, trained optimizer keeps its state.
        backward_passes_per_step: N > 1 accumulates gradients locally for N calls of ``apply`` and only then
            allreduces and applies once (N times fewer collectives). ``optimizer.iterations`` counts applied
            updates, i.e. advances every N-th call.
        average_aggregated_gradients: with N > 1, divide the local sum by N (mean over the N micro-batches,
            what you want for mean-reduced losses). False applies the sum.
        compression: ``None``/``"none"`` or ``"fp16"`` (cast float gradients to float16 on the wire), or a
            ``horovod.tensorflow.Compression`` class.
        sparse_as_dense: convert ``tf.IndexedSlices`` gradients (e.g. from ``Embedding``) to dense tensors
            before the allreduce. Otherwise they are allgathered (cheaper for small, sparse updates).
        op: ``"average"`` (default) or ``"sum"`` (or ``"adasum"``, MPI builds only), or a Horovod op constant.

    With one rank the allreduce is skipped (identity); everything else behaves the same.
    Inside XLA (``jit_compile=True``) it raises a clear error: Horovod is built without XLA ops.
    """
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("optimizer is already a keras_lms.horovod.DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"expected a Keras 3 optimizer (keras.optimizers.Optimizer), got {type(optimizer).__name__}; "
            "tf.keras / legacy optimizers are not supported"
        )
    n = int(backward_passes_per_step)
    if n < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    settings = _Settings(
        backward_passes_per_step=n,
        average_aggregated_gradients=bool(average_aggregated_gradients),
        compression=_resolve(_COMPRESSION, compression, "compression"),
        sparse_as_dense=bool(sparse_as_dense),
        op=_resolve(_OPS, op, "op"),
    )
    cls = _distributed_class(type(optimizer))
    new = cls.from_config(optimizer.get_config())
    object.__setattr__(new, "_hvd_settings", settings)
    if optimizer.built:
        tvars = getattr(optimizer, "_trainable_variables", None)
        if tvars is None and hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
            tvars = optimizer.inner_optimizer._trainable_variables
        new.build(list(tvars))
        new.built = True
        if len(new.variables) != len(optimizer.variables):  # pragma: no cover - defensive
            raise RuntimeError("could not copy the state of the built optimizer")
        for dst, src in zip(new.variables, optimizer.variables):
            dst.assign(src)
    return new


def is_distributed(optimizer) -> bool:
    """True if ``optimizer`` was made by :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _DistributedMixin)


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True, **distributed_kwargs):
    """``keras.saving.load_model`` and, if the model was compiled, wrap its optimizer (state preserved).

    A model saved with a ``DistributedOptimizer`` stores the plain inner optimizer, so it loads anywhere;
    this helper restores the distributed behaviour for resumed multi-rank training.
    ``distributed_kwargs`` go to :func:`DistributedOptimizer`.
    """
    model = keras.saving.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                    safe_mode=safe_mode)
    if compile and getattr(model, "optimizer", None) is not None and not is_distributed(model.optimizer):
        model.optimizer = DistributedOptimizer(model.optimizer, **distributed_kwargs)
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(model, attr):
                setattr(model, attr, None)
    return model
