"""Fused slab chains: ``BatchNormalization -> activation -> convolution`` recomputed from one host copy.

Per call, a slab-computed step copies the BatchNorm's input ``c`` and the convolution's input ``r =
act(bn(c))`` to host, and its backward brings back ``r``'s windows twice (the convolution's, with halos, and the
activation's own) and ``c``'s twice (BatchNorm's two passes). When each of the three is the only consumer of
the one before, nothing else needs ``r``: the convolution's backward cuts windows of ``c``'s host copy instead,
recomputes ``r`` on them from the forward's batch statistics (an element-wise chain), and with the same
windows also takes the activation's gradient and the first pass of BatchNorm's (the gradient reaching its
batch mean and variance, summed over slabs). The activation's backward and BatchNorm's first pass then run
nothing, and ``r`` is never copied: per such chain 1 tensor goes out instead of 2 and about 2.3 come back
instead of 4.3 (with 3x3x3 convolutions in 15-row slabs).

The values are the unfused path's: the recomputed windows are the forward's element-wise ops on the same
elements, and the first-pass sums are taken over the same slab bounds in the same order (a chain is fused only
when the convolution's slabs and the BatchNorm's coincide). ``tests/offload/tensorflow/test_slab_chains.py``
compares fused with unfused gradients and both with the plain model, and counts the bytes in the executed graph.

A second, shorter chain, ``BatchNormalization -> activation`` where the activation's output has other
consumers (a U-Net's skip, read by the pooling and the decoder) or a consumer that cannot fuse: the
activation's slab backward cuts windows of ``c`` instead of its output's copy (the same bytes), recomputes its
output on them and takes BatchNorm's first pass there, so BatchNorm's backward reads ``c`` once instead of twice.
Its plan entry says ``recompute_from = (BatchNorm call, None)``. It is off by default (``SHORT_CHAINS``): it
saves another ~5% of the traffic (384^3 float32: 97 -> 92 GiB per step) but its backward holds the recomputed
BatchNorm temporaries (float32, transposed by grappler's layout optimiser) while the skip's and the pooling's
gradients are live, which is the step's peak: +0.48 GiB at 400^3 float32 and +0.97 GiB at 496^3 mixed_float16
(simulated), pushing both largest cubes over 16 GiB. So it is off by default and chosen per chain by the
budget planner where the budget has room for those temporaries and the step is shorter (``short`` below;
``planning.chain_plan``; ``TensorFlowFacts.short_chain_bytes`` charges them).

``ENABLED = False`` turns fusion off (for comparisons); ``SHORT_CHAINS = True`` fuses every short chain.
"""

from __future__ import annotations

from keras_lms.planning import layer_facts
from keras_lms.planning.plan import call_graph

ENABLED = True
SHORT_CHAINS = False


def fused_chains(calls, offloaded, slabs: dict, facts, short=frozenset()) -> dict:
    """Convolution call index -> (BatchNorm call index, activation call index) of every chain fused (see the
    module docstring), from the traced calls, the per-call offload decisions and the slab plans; and activation
    call index -> (BatchNorm call index, None) for the short chains among ``short`` (activation indices, or
    True for every one; every one with ``SHORT_CHAINS``)."""
    if not ENABLED or not slabs:
        return {}
    producers, consumers = call_graph(calls)
    chains = {}
    for v, plan in slabs.items():
        conv = calls[v]
        if (plan.moments or len(conv.keys) != 1 or not any(offloaded[v])
                or not layer_facts.is_keras_class(conv.unit, layer_facts.CONV_LAYERS)):
            continue
        r = producers.get(conv.keys[0])
        if r is None or consumers.get(conv.keys[0]) != [v] or len(calls[r].keys) != 1:
            continue
        act = calls[r].unit
        if (facts.output_gradient_activation(act) is None or getattr(act, "trainable_variables", None)
                or getattr(act, "activity_regularizer", None) is not None):
            continue
        b = producers.get(calls[r].keys[0])
        if b is None or consumers.get(calls[r].keys[0]) != [r] or b not in slabs:
            continue
        if not (slabs[b].moments and any(offloaded[b]) and slabs[b].bounds == plan.bounds
                and getattr(calls[b].unit, "activity_regularizer", None) is None):
            continue
        chains[v] = (b, r)
    if not (SHORT_CHAINS or short):
        return chains
    between = {r for _, r in chains.values()}
    for r, plan in slabs.items():  # BatchNorm -> activation, the activation's output copied by its consumers
        act = calls[r]
        if not (SHORT_CHAINS or short is True or r in short):
            continue
        if (r in between or len(act.keys) != 1 or facts.output_gradient_activation(act.unit) is None
                or getattr(act.unit, "trainable_variables", None)
                or getattr(act.unit, "activity_regularizer", None) is not None):
            continue
        b = producers.get(act.keys[0])
        if b is None or consumers.get(act.keys[0]) != [r] or b not in slabs or b in {s for s, _ in chains.values()}:
            continue
        if not (slabs[b].moments and any(offloaded[b]) and slabs[b].bounds == plan.bounds
                and getattr(calls[b].unit, "activity_regularizer", None) is None):
            continue
        out = act.output_keys[0] if act.output_keys else None
        # its backward reads windows of its output's copy today; it reads c's copy instead
        if out is not None and any(_offloads(calls[c], offloaded[c], out) for c in consumers.get(out, [])):
            chains[r] = (b, None)
    return chains


def _offloads(call, row, key) -> bool:
    return any(off for k, off in zip(call.keys, row) if k == key)
