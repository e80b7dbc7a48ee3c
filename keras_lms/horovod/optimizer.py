"""`DistributedOptimizer`: average gradients across ranks inside `Optimizer.apply`.

Why not `horovod.tensorflow.keras.DistributedOptimizer`: it was written for tf.keras 2, where `fit` called
`optimizer.get_gradients`/`_compute_gradients` and Horovod averaged there. Keras 3's `train_step` computes
gradients with its own `GradientTape` and calls `optimizer.apply_gradients` -> `optimizer.apply` directly,
so Horovod's hook never runs and every rank silently trains on its own gradients.

Where we hook, and why it cannot be skipped (Keras 3.15, `keras/src/optimizers/base_optimizer.py`):
`apply_gradients(grads_and_vars)` only unzips and calls `self.apply(grads, vars)`; `apply` builds the
optimizer if needed, filters `None` gradients, unscales (`loss_scale_factor`) and calls
`_backend_apply_gradients` (Keras' own gradient accumulation, clipping, weight decay, `update_step`, EMA).
`LossScaleOptimizer` forwards to `inner_optimizer.apply`; the TensorFlow backend's `stateless_apply`
raises. So `apply` is the single public entry every update goes through, in `fit` and in custom loops; we
override it and allreduce *before* calling the original, i.e. before clipping/weight decay, so clipping sees
the averaged gradient exactly as single-process large-batch training would.

How the wrapper is made: like Horovod, a subclass of the optimizer's own class is created on the fly and
instantiated from `optimizer.get_config()`. `isinstance(opt, keras.optimizers.SGD)` stays true,
`get_config()` is the inner optimizer's config, and saving serialises it under the inner class' public name
(`keras.optimizers.SGD`), so a saved model loads without Horovod (as a plain optimizer; use
`load_model` to load and re-wrap in one step).
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
_STEP_MISMATCH = (
    "keras_lms.horovod: the ranks ran different numbers of training batches in this epoch: one rank's data "
    "ended while another was still training, so the ranks would wait for each other forever. Shard the data so "
    "that every rank gets the same number of batches: e.g. dataset.shard(lhvd.size(), lhvd.rank()) on a dataset "
    "whose length is a multiple of size() x batch_size, .batch(batch_size, drop_remainder=True) after sharding, "
    "or the same steps_per_epoch= on every rank (with .repeat())."
)


@dataclasses.dataclass(frozen=True)
class _Settings:
    name: str = ALLREDUCE_NAME
    device_dense: str = ""
    device_sparse: str = ""
    compression: Any = hvd.Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    op: Any = hvd.Average
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    groups: Any = None  # None, an int > 0, or a tuple of tuples of variables
    process_set: Any = hvd.global_process_set
    scale_local_gradients: bool = True
    iterations: str = "per_pass"


class _DistributedMixin:
    """Methods mixed in front of the inner optimizer's class (see module docstring)."""

    # Class default, so `from_config`/cloning of the dynamic class still gives a working distributed optimizer.
    _hvd_settings = _Settings()
    _hvd_accumulators = None
    _hvd_counter = None
    _hvd_local_keys = frozenset()

    # ------------------------------------------------------------------ worker-local variables
    def register_local_var(self, var):
        """Keep `var`'s gradient local: it is not allreduced (Horovod's `register_local_var`).

        With `scale_local_gradients=True` (the default) the local gradient is divided by the number of ranks,
        as Horovod does. Register before the first training step (the step is traced once). Every rank must
        register the same variables, or the ranks allreduce different lists.
        """
        object.__setattr__(self, "_hvd_local_keys", self._hvd_local_keys | {self._var_key(var)})

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
            variables = trainable_variables
            if variables is None and self.built:
                variables = self._trainable_variables
            return super().apply(self._hvd_allreduce(grads, variables), trainable_variables)
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
        st = self._hvd_settings
        n = st.backward_passes_per_step
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
        scale = 1.0 / n if st.average_aggregated_gradients else 1.0

        def _apply_aggregated():
            agg = [acc.read_value() * scale if p else None for acc, p in zip(accs, present)]
            parent_apply(self._hvd_allreduce(agg, variables), variables)
            for acc in accs:
                acc.assign(tf.zeros_like(acc))

        def _pass_only():
            if st.iterations == "per_pass":  # Horovod (and Keras' own accumulation) count every pass
                self.iterations.assign_add(1)

        # Every rank has the same counter, so all take the same branch and the collective cannot hang.
        tf.cond(tf.equal(step % n, 0), _apply_aggregated, _pass_only)

    # -------------------------------------------------------------------------------------- allreduce
    def _hvd_allreduce(self, grads, variables=None):
        """Allreduce all non-None, non-local gradients (identity when the process set has one rank)."""
        st = self._hvd_settings
        keys = [self._var_key(v) for v in variables] if variables is not None else [None] * len(grads)
        if self._hvd_local_keys and variables is None:
            raise ValueError("register_local_var() needs the variables: call apply(grads, variables).")
        local = [k in self._hvd_local_keys for k in keys]
        idx = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        ps_size = st.process_set.size()
        out = list(grads)
        if st.scale_local_gradients and self._hvd_local_keys:
            for i, g in enumerate(grads):
                if g is not None and local[i]:
                    out[i] = (tf.IndexedSlices(g.values / ps_size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / ps_size)
        if not idx or ps_size == 1:
            return out
        if in_xla_context():
            raise RuntimeError(XLA_ERROR)
        tensors = {}
        for i in idx:
            g = grads[i]
            if isinstance(g, tf.IndexedSlices):
                if st.sparse_as_dense:
                    g = tf.convert_to_tensor(g)
            elif not tf.is_tensor(g):
                g = tf.convert_to_tensor(g)
            tensors[i] = g
        groups = self._hvd_groups(idx, keys)
        # Remember the structure, so that a rank whose epoch ended can send a matching "no more steps" marker.
        object.__setattr__(self, "_hvd_structure", [
            [("sparse", tuple(tensors[i].values.shape[1:]), tensors[i].values.dtype, tensors[i].indices.dtype)
             if isinstance(tensors[i], tf.IndexedSlices) else ("dense", tuple(tensors[i].shape), tensors[i].dtype)
             for i in group] for group in groups])
        reduced = self._hvd_reduce([[tensors[i] for i in group] for group in groups], in_step=True)
        for group, values in zip(groups, reduced):
            for i, r in zip(group, values):
                out[i] = r
        return out

    def _hvd_reduce(self, groups, in_step: bool):
        """One grouped allreduce per group, each with a "rank is in a training step" flag appended.

        The flag is 1 from a training step and 0 from `_hvd_end_of_epoch`. All ranks in a step: the
        average is 1. A rank that ran out of batches while another still trains: that collective pairs the
        other rank's step with this rank's end-of-epoch marker, both see a value strictly between 0 and 1 and
        raise, instead of waiting for each other forever. (Adasum: no flag; it does not average.)
        """
        st = self._hvd_settings
        if st.op is hvd.Average:
            # Horovod's split average: x / f summed, then * f / size (the size factor is applied by Horovod).
            pre, post = 1.0 / st.gradient_predivide_factor, st.gradient_predivide_factor
        else:
            pre, post = 1.0, 1.0
        flagged = st.op is not hvd.Adasum
        expected = 1.0 if in_step else 0.0
        out = []
        for g_i, group in enumerate(groups):
            name = st.name if g_i == 0 else f"{st.name}_group{g_i}"
            tensors = list(group)
            if flagged:
                tensors.append(tf.constant([expected], tf.float32))
            # IndexedSlices (sparse_as_dense=False) are allgathered by grouped_allreduce: values are divided by
            # size for Average, and duplicate indices are summed when the optimizer scatter-adds them.
            # A fixed name: unnamed, Horovod names the collective after the gradient tensors, whose names embed
            # Keras' per-process layer-name counters; ranks that built different layers would never match (hang).
            reduced = hvd.grouped_allreduce(
                tensors, op=st.op, compression=st.compression,
                device_dense=st.device_dense, device_sparse=st.device_sparse,
                prescale_factor=pre, postscale_factor=post, process_set=st.process_set,
                name=name, ignore_name_scope=True)
            if flagged:
                flag = reduced[-1][0]
                if st.op is hvd.Sum:
                    flag = flag / st.process_set.size()
                check = tf.debugging.assert_near(
                    flag, tf.constant(expected, tf.float32), atol=1e-3, message=_STEP_MISMATCH)
                with tf.control_dependencies([check]):
                    reduced = [tf.identity(r) if not isinstance(r, tf.IndexedSlices) else r for r in reduced[:-1]]
            out.append(list(reduced))
        return out

    def _hvd_end_of_epoch(self) -> None:
        """Send the "this rank has no more steps" marker (see `_hvd_reduce`); a collective.

        Called by the collective callbacks at every epoch end when fit() cannot know the steps per epoch
        up front (generators, tf.data of unknown cardinality). Raises on every rank if another rank is still
        in a training step.
        """
        structure = getattr(self, "_hvd_structure", None)
        st = self._hvd_settings
        if not structure or st.op is hvd.Adasum or st.process_set.size() == 1:
            return

        @tf.function(autograph=False)
        def _marker():
            groups = []
            for group in structure:
                tensors = []
                for item in group:
                    if item[0] == "dense":
                        tensors.append(tf.zeros(item[1], item[2]))
                    else:
                        _, shape, vdtype, idtype = item
                        tensors.append(tf.IndexedSlices(tf.zeros((0,) + shape, vdtype), tf.zeros((0,), idtype)))
                groups.append(tensors)
            self._hvd_reduce(groups, in_step=False)
            return tf.constant(0)

        _marker()

    def _hvd_groups(self, idx, keys):
        """Index lists, one grouped allreduce each (Horovod's `groups`): one group unless asked otherwise."""
        groups = self._hvd_settings.groups
        if groups is None:
            return [idx]
        if isinstance(groups, int):
            n = min(groups, len(idx))
            size, extra = divmod(len(idx), n)
            out, start = [], 0
            for g in range(n):
                stop = start + size + (1 if g < extra else 0)
                out.append(idx[start:stop])
                start = stop
            return out
        position = {keys[i]: i for i in idx}
        out = []
        for group in groups:
            members = [position.pop(self._var_key(v)) for v in group if self._var_key(v) in position]
            if members:
                out.append(sorted(members))
        out.extend([i] for i in idx if keys[i] in position)  # the rest: one group each, as in Horovod
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
