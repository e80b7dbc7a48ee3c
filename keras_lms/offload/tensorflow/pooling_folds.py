"""A U-Net skip's pooling gradient taken window by window in its activation's slab backward (levels not swept).

A U-Net encoder level's output ``r`` (the skip) is read by a max pooling and by the decoder's concatenation, so its
gradient arrives in two whole parts: the concatenation's, which waits from the decoder down, and the pooling's,
which the pooling's slab backward assembles from window pieces after bringing ``r``'s windows back from host.
TensorFlow's tape then adds the two in an ``AddN`` before the activation's backward, which brings the same windows
back again for its own gradient. At the junction the skip part, the pooling's pieces, their concatenation and the
sum are live at once (four level-0 tensors): the peak of the step where the level is not swept (the GH200 plans,
which sweep nothing: 15.86 GiB predicted at 400^3 float32 with a 16 GiB budget, over the planner's margin).

A level sweep already folds the pooling into its first pass (``sweeps.Sweep.folded``). Here the same fold is made
where the activation is slab-computed but not swept: the pooling's backward hands its output gradient to the
activation's record and returns no input gradient (the concatenation's part alone reaches the activation, no sum),
and the activation's slab backward adds, per window ``[s0, s1)``, the pooling recomputed on the output rows it
brings back anyway and differentiated for its output gradient's rows ``[s0 / k, s1 / k)``. For that the
activation's windows are the pooling's (their starts multiples of its stride ``k``: ``aligned``), so each window
owns its pooled rows. The pooling's backward brings nothing back (one level-0 tensor less over the link), and the
values are the unfolded step's: the same window-wise pooling gradient, added to the same skip part.

``ENABLED = False`` is the control (tests/offload/tensorflow/test_pooling_folds.py).
"""

from __future__ import annotations

import dataclasses

from keras_lms.offload.tensorflow import sweeps
from keras_lms.offload.tensorflow.slab_plan import slab_bounds
from keras_lms.planning.plan import call_graph

ENABLED = True


def pooling_folds(calls, offloaded, slabs: dict, facts) -> dict:
    """Pooling call index -> ``(activation call index, stride)`` for every fold this step can make (module
    docstring): the activation is slab-computed, weightless and differentiated from its output, its output's
    readers are a tiling pooling and a concatenation (``sweeps.folded_pooling``), and the pooling is cut into as
    many slabs over the same rows. A level sweep of the activation folds the pooling itself; the caller drops
    those. ``facts``: the back end's ``TensorFlowFacts``."""
    if not ENABLED or not slabs:
        return {}
    _, consumers = call_graph(calls)
    folds = {}
    for act, plan in slabs.items():
        call = calls[act]
        if (facts.output_gradient_activation(call.unit) is None  # (its slab backward's window path)
                or getattr(call.unit, "trainable_variables", None)
                or len(call.keys) != 1 or len(call.output_keys) != 1 or plan.moments or plan.halo):
            continue
        found = sweeps.folded_pooling(calls, act, offloaded, consumers, plan.length)
        if found is None:
            continue
        pool, stride = found
        other = slabs.get(pool)
        if other is not None and other.count == plan.count and other.length == plan.length:
            folds[pool] = (act, stride)
    return folds


# Whether a folding activation's BatchNormalization is cut into the same windows (``alignments``); off: the
# activation alone (the control of tests/offload/tensorflow/test_pooling_folds.py).
ALIGN_NORMALIZATION = True


def alignments(calls, offloaded, slabs: dict, facts) -> dict:
    """Call index -> the row multiple its slab windows start on: each folding activation (``pooling_folds``) its
    pooling's stride, and so does the BatchNormalization that feeds it alone in the same windows. Why the
    BatchNorm too: a short chain (``slab_chains``: the activation's backward recomputes its output from the
    BatchNorm input's copy and takes BatchNorm's first pass) needs the two in the same windows; cut apart by the
    fold, the skip's ReLU could have its pooling's gradient or the short chain, not both (496^3
    mixed_float16 on GH200: 1.17x the plain step with the fold alone, 1.14x with both)."""
    producers, consumers = call_graph(calls)
    out = {}
    for pool, (act, _) in pooling_folds(calls, offloaded, slabs, facts).items():
        stride = slabs[pool].stride
        out[act] = stride
        key = calls[act].keys[0]
        b = producers.get(key)
        if (ALIGN_NORMALIZATION and b in slabs and consumers.get(key) == [act]
                and slabs[b].bounds == slabs[act].bounds):
            out[b] = stride
    return out


def aligned(calls, offloaded, slabs: dict, facts) -> dict:
    """``slabs`` with each call cut into the windows ``alignments`` gives it."""
    for i, stride in alignments(calls, offloaded, slabs, facts).items():
        slabs[i] = aligned_plan(slabs[i], stride)
    return slabs


def aligned_plan(plan, stride: int):
    """An activation's slab plan with the same number of windows, their starts multiples of ``stride``."""
    return dataclasses.replace(plan, bounds=slab_bounds(plan.length, plan.count, stride))
