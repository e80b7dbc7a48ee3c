"""The TensorFlow step context's folded poolings (``StepContext`` inherits them): a U-Net skip's pooling whose input
gradient its activation's slab backward takes window by window (what and why: ``pooling_folds``)."""

from __future__ import annotations

import logging

import tensorflow as tf

from keras_lms.offload.tensorflow import pooling_folds, slabs

log = logging.getLogger("keras_lms")


class PoolingFoldCalls:
    """Binds, checks and runs the folds the plan names (``PlanEntry.folded_pooling`` on the activation's entry;
    a mixin of ``StepContext``: it reads the context's ``records``, ``_slab_call`` and ``SlabCalls``'s
    window-path checks)."""

    @staticmethod
    def _planned_alignment(decision, plan):
        """A call whose windows the plan aligns (``PlanEntry.slab_align``: an activation the plan folds a pooling
        into, and its BatchNorm) is cut into them, as the planner's ``slab_plans`` cut it
        (``pooling_folds.alignments``), swept or not."""
        stride = getattr(decision, "slab_align", 1)
        if stride > 1 and plan is not None:
            return pooling_folds.aligned_plan(plan, stride)
        return plan

    def _bind_pooling_fold(self, record, decision, tensors) -> None:
        """At an offloaded call's forward: an activation the plan folds a pooling into waits for it (not where a
        level sweep differentiates it: the sweep folds the pooling); a pooling that was waited for must read
        that activation's output alone, in the same windows, else its own backward takes its gradient (with a
        warning: the plan's memory was predicted for the fold)."""
        if getattr(decision, "folded_pooling", None) and decision.sweep is None and record.slabs is not None:
            self.pooling_folds[decision.folded_pooling[0]] = record
        act = self.pooling_folds.get(record.index)
        if act is None:
            return
        if (not reads_output_alone(tensors, act) or record.slabs is None
                or record.slabs.bounds != act.slabs.bounds):
            log.warning("keras-lms: %r does not read %r's output in its windows as planned; its gradient is taken "
                        "by its own backward, not the activation's.", record.unit.name, act.unit.name)
            del self.pooling_folds[record.index]

    def _foldable(self, act) -> bool:
        """Whether the activation's slab backward can take the pooling's gradient (``SlabCalls._slab_backward``'s
        window path: its output's host copy, or a short chain's windows, and one output)."""
        return (act.slabs is not None and self._output_gradient_kernel(act) is not None
                and self._reads_output_windows(act))

    def _hand_pooling_gradient(self, record, dy):
        """A folded pooling's backward: its output gradient handed to the activation's record, no input gradient
        (the concatenation's part alone reaches the activation: no whole sum); or None where the activation
        cannot take it, and the pooling differentiates itself."""
        act = self.pooling_folds.get(record.index)
        if act is None or dy is None or not self._foldable(act):
            return None
        act.pooling_fold = (record, dy, record.slabs.stride)
        return [None] * (len(record.hosts) + len(record.trainable))

    def _pooling_rows(self, act, r, s0: int, s1: int):
        """Rows [s0, s1) of the folded pooling's input gradient: the pooling recomputed on the activation's output
        rows ``r`` and differentiated for its output gradient's rows [s0 / stride, s1 / stride) (it tiles: those
        are the window's own)."""
        pooling, dy, stride = act.pooling_fold
        return pooling_input_gradient(self, pooling, r, slabs.rows(dy, s0 // stride, s1 // stride))

    @staticmethod
    def _check_pooling_fold_taken(record, upstream) -> None:
        """An activation holding a pooling's gradient must take it in its slab backward (a bug if not)."""
        if getattr(record, "pooling_fold", None) is not None and (len(upstream) != 1 or upstream[0] is None):
            raise RuntimeError(f"keras-lms: {record.unit.name!r} holds a folded pooling's gradient but has no "
                               "gradient of its own to add it to; set "
                               "keras_lms.offload.tensorflow.pooling_folds.ENABLED = False")


def reads_output_alone(tensors, record) -> bool:
    """Whether a call's tensor inputs are exactly ``record``'s (first) output (a folded pooling's check)."""
    return len(tensors) == 1 and record.output_key is not None and tensors[0].ref() == record.output_key


def pooling_input_gradient(context, pooling, r, dy_rows):
    """The pooling's input gradient on rows ``r`` for its output gradient's rows ``dy_rows`` (a tiling pooling:
    the rows ``r`` pool to exactly those), recomputed with the pooling's own call (``_slab_call``)."""
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(r)
        y = tf.nest.flatten(context._slab_call(pooling, [r], pooling.trainable)[0])[0]
    return tape.gradient(y, r, output_gradients=dy_rows)
