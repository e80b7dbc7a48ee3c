"""How `DistributedOptimizer` averages gradients: a mixin in front of the optimizer's own class.

Where we hook, and why it cannot be skipped (Keras 3.15, `keras/src/optimizers/base_optimizer.py`):
`apply_gradients(grads_and_vars)` only unzips and calls `self.apply(grads, vars)`; `apply` builds the
optimizer if needed, filters `None` gradients, unscales (`loss_scale_factor`) and calls
`_backend_apply_gradients` (Keras' own gradient accumulation, clipping, weight decay, `update_step`, EMA).
`LossScaleOptimizer` forwards to `inner_optimizer.apply`; the TensorFlow backend's `stateless_apply`
raises. So `apply` is the single public entry every update goes through, in `fit` and in custom loops; we
override it and allreduce *before* calling the original, i.e. before clipping/weight decay, so clipping sees
the averaged gradient exactly as single-process large-batch training would.

How the wrapper class is made: like Horovod, a subclass of the optimizer's own class is created on the fly
(`distributed_class`), with the inner class' name, module and serialisation name, so
`isinstance(opt, keras.optimizers.SGD)` stays true and a saved model stores the plain inner optimizer.
Besides `apply`, the mixin adds `register_local_var` (keep a variable's gradient local),
`backward_passes_per_step` accumulation, the end-of-epoch marker that turns a rank-count mismatch into an
error instead of a hang, and what an elastic commit and reset need (`aggregation_variables`, `forget_structure`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from .. import _keras_adapter as adapter
from ._hvd import XLA_ERROR, hvd, in_xla_context, tf

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

    def _hvd_key(self, variable):
        """The key Keras indexes `variable`'s optimizer state by (a keras.Variable and its tf.Variable agree)."""
        return adapter.optimizer_variable_key(self, variable)

    # ------------------------------------------------------------------ worker-local variables
    def register_local_var(self, var):
        """Keep `var`'s gradient local: it is not allreduced (Horovod's `register_local_var`).

        With `scale_local_gradients=True` (the default) the local gradient is divided by the number of ranks,
        as Horovod does. Register before the first training step (the step is traced once). Every rank must
        register the same variables, or the ranks allreduce different lists.
        """
        object.__setattr__(self, "_hvd_local_keys", self._hvd_local_keys | {self._hvd_key(var)})

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
                index[self._hvd_key(v)] = i
            counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_local_step")
        object.__setattr__(self, "_hvd_accumulators", accs)
        object.__setattr__(self, "_hvd_acc_index", index)
        object.__setattr__(self, "_hvd_vars", list(variables))
        object.__setattr__(self, "_hvd_counter", counter)

    def aggregation_variables(self) -> list:
        """The `backward_passes_per_step` buffers and pass counter (empty without aggregation).

        They are plain tf.Variables that Keras does not track (not in `optimizer.variables`), so whoever saves the
        optimizer's whole state (an elastic commit) must ask for them here.
        """
        return [v for v in list(self._hvd_accumulators or []) + [self._hvd_counter] if v is not None]

    # ------------------------------------------------------------------------------------------ apply
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._hvd_settings.backward_passes_per_step == 1:
            variables = trainable_variables
            if variables is None and self.built:
                variables = adapter.optimizer_trainable_variables(self)
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
        accs = [self._hvd_accumulators[self._hvd_acc_index[self._hvd_key(v)]] for v in variables]
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
        keys = [self._hvd_key(v) for v in variables] if variables is not None else [None] * len(grads)
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

    def forget_structure(self) -> None:
        """Forget the gradients' shapes that the end-of-epoch marker sends; the next training step records them.

        An elastic reset calls it: the step is retraced for the new set of ranks, and until then there is no
        structure to match. (Set with `object.__setattr__`, past Keras' tracking, so removed from the instance.)
        """
        vars(self).pop("_hvd_structure", None)

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
            members = [position.pop(self._hvd_key(v)) for v in group if self._hvd_key(v) in position]
            if members:
                out.append(sorted(members))
        out.extend([i] for i in idx if keys[i] in position)  # the rest: one group each, as in Horovod
        return out


_CLASS_CACHE: dict[type, type] = {}


def distributed_class(base: type) -> type:
    """The subclass of optimizer class `base` with the mixin in front; named, and serialised, like `base`.

    Saving a model must not require keras_lms or Horovod to load it, so instances serialise exactly as
    `base`'s (`adapter.serialize_like`). One class per `base`, cached.
    """
    cls = _CLASS_CACHE.get(base)
    if cls is not None:
        return cls
    cls = type(
        base.__name__,
        (_DistributedMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__},
    )
    adapter.serialize_like(cls, base)
    _CLASS_CACHE[base] = cls
    return cls
