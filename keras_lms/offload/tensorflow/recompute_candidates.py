"""Which tensors the TensorFlow back end can recompute instead of copying (``planning.recompute``), from shapes.

A tensor ``T = p(S)`` can be recomputed window by window when:

- its producer ``p`` is a slab-computed, offloaded call that keeps the number of rows (a stride-1 "same"
  convolution, a BatchNormalization with slab batch statistics, an element-wise activation without weights), so
  rows ``[a, b)`` of ``T`` are ``p`` run on rows ``[a - h, b + h)`` of its inputs, cropped, exactly as the slab
  forward computes them, with the forward's batch statistics and the snapshot of the weights;
- ``p``'s inputs can be read as windows: each one copied by ``p`` itself, or recomputed in turn (a fused chain's
  activation output, or another recomputed tensor);
- every call whose backward reads ``T`` reads it as windows: a slab-computed offloaded call (or the slab reader
  of a concatenation that is never built), or ``p`` itself when it is an activation differentiated from its
  output. A call that would bring ``T`` back whole disqualifies it (the whole tensor would be recomputed on the
  device, which is what offloading avoids).

Fused chains (``slab_chains``) recompute their BatchNorm and activation outputs by themselves; they are listed
too, with ``chosen=False``, so that a read through them expands to the BatchNorm input's host copy.
"""

from __future__ import annotations

from keras_lms.offload.tensorflow.slab_costs import read_parts
from keras_lms.offload.tensorflow.slab_plan import AXIS, computes_in_slabs_forward
from keras_lms.planning import layer_facts
from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.plan import call_graph, tensor_bytes
from keras_lms.planning.recompute import RecomputeSource


def recompute_sources(calls, offloaded, slabs: dict, chains: dict, parts: dict, elided: dict, facts,
                      batch_size: int) -> dict:
    """Tensor key -> ``RecomputeSource`` for every tensor this back end can recompute (module docstring)."""
    _, consumers = call_graph(calls)
    sources = {}
    for v, (b, r) in chains.items():
        if r is None:
            continue
        for producer in (b, r):  # BatchNorm's output, then the activation's: element-wise, halo 0
            sources[calls[producer].output_keys[0]] = _source(calls, producer, slabs[v].length, 0, batch_size,
                                                              chosen=False)
    upsamplers = {p: scale for p, scale in ((p, _upsampling(calls[p])) for p in range(len(calls)))
                  if scale is not None and p not in slabs}
    for p in sorted(set(slabs) | set(upsamplers)):
        call = calls[p]
        if p in upsamplers:
            if _read_as_windows(calls, p, consumers, offloaded, slabs, elided, facts):
                length = call.output_shapes[0][AXIS]
                size = tensor_bytes(call.shapes[0], call.dtypes[0], batch_size)
                sources[call.output_keys[0]] = RecomputeSource(
                    call.output_keys[0], p, ((call.keys[0], size),), length, 0, *_per_row(call, length, batch_size),
                    exact_rows=True, scale=upsamplers[p], resident=() if offloaded[p][0] else (call.keys[0],))
            continue
        plan = slabs[p]
        if (len(call.output_keys) != 1 or call.output_keys[0] in sources or plan.stride != 1
                or (p in chains and chains[p][1] is None)):
            continue
        if not _local_producer(call.unit, plan, facts):
            continue
        inputs, concatenated = read_parts(calls, p, parts, batch_size)
        row = list(offloaded[p]) * len(inputs) if concatenated else list(offloaded[p])
        if not all(off or key in sources for (key, _, _), off in zip(inputs, row)):
            continue
        if not _read_as_windows(calls, p, consumers, offloaded, slabs, elided, facts):
            continue
        sources[call.output_keys[0]] = RecomputeSource(
            call.output_keys[0], p, tuple((k, s) for k, s, _ in inputs), plan.length, plan.halo,
            *_per_row(call, plan.length, batch_size), exact_rows=plan.exact_rows)
    return sources


def _upsampling(call) -> int | None:
    """The scale of an up-sampling call of one input (``layer_facts.upsampling_scale``), with output rows
    ``scale`` times its input's; None otherwise. Its input is copied by itself (its own backward reads the copy)
    or kept on the device (its windows are sliced there)."""
    if len(call.keys) != 1 or len(call.output_keys) != 1:
        return None
    shape, out_shape = call.shapes[0], call.output_shapes[0]
    scale = layer_facts.upsampling_scale(call.unit, len(shape))
    if scale is None or len(out_shape) != len(shape) or shape[AXIS] is None:
        return None
    return scale if out_shape[AXIS] == scale * shape[AXIS] else None


def _source(calls, producer: int, length: int, halo: int, batch_size: int, chosen: bool) -> RecomputeSource:
    call = calls[producer]
    size = tensor_bytes(call.shapes[0], call.dtypes[0], batch_size)
    return RecomputeSource(call.output_keys[0], producer, ((call.keys[0], size),), length, halo,
                           *_per_row(call, length, batch_size), chosen=chosen)


def _per_row(call, length: int, batch_size: int) -> tuple:
    cost = call_cost(call, batch_size)
    return cost.forward_flops / length, cost.forward_bytes / length


def _local_producer(unit, plan, facts) -> bool:
    if layer_facts.is_keras_class(unit, layer_facts.CONV_LAYERS):
        return computes_in_slabs_forward(unit)
    if plan.moments:
        return True
    return (layer_facts.standalone_activation(unit) is not None and not getattr(unit, "trainable_variables", None))


def _read_as_windows(calls, p: int, consumers: dict, offloaded, slabs: dict, elided: dict, facts) -> bool:
    """Whether every backward that reads call ``p``'s output reads it in windows (module docstring)."""
    key = calls[p].output_keys[0]
    readers = [c for c in consumers.get(key, []) if c != p]
    if not readers:
        return False
    for c in readers:
        if c in elided:
            reader = elided[c]
            if reader not in slabs or not any(offloaded[reader]):
                return False
            continue
        if not facts.backward_reads(calls[c].unit)[0]:
            continue  # its backward reads no inputs (an activation differentiated from its output, a reshape)
        if c not in slabs or not all(off for k, off in zip(calls[c].keys, offloaded[c]) if k == key):
            return False
    return True
