"""Which tensors the torch back end recomputes instead of copying (``planning.recompute``), from shapes.

On torch a layer call's backward reads its inputs whole. A ``Conv -> BatchNormalization -> ReLU -> Conv`` unit
copies two full-size tensors per step: the BatchNorm's input ``c`` (the lean normalisation's backward reads it)
and the ReLU's output ``r`` (the next call's input, which the ReLU's own gradient reads too). ``r`` is an
element-wise function of ``c`` given the forward's batch statistics, which the lean normalisation keeps. So the
backward of ``r``'s reader can bring ``c`` back instead, recompute ``r`` on the device (a few passes over the
tensor at HBM speed, against about 0.1 s per GiB back over PCIe) and hand ``c`` on to the BatchNorm's backward,
two calls later: ``r`` is never copied, and ``c`` still comes back once (``recomputed_outputs``).

A tensor ``T`` is a candidate when:

- its producer is a BatchNormalization call of the lean normalisation (``step_memory.lean_normalization_call``:
  Keras' own layer with batch statistics) whose input is copied to host, or a weightless activation layer
  differentiated from its output (relu, sigmoid, tanh) whose input is such a BatchNorm's output and read by
  nothing else: ``T = bn(c)`` or ``T = act(bn(c))``;
- exactly one other call copies ``T`` and reads it in its backward. ``T`` is then recomputed once, by that
  backward; a second reader would recompute it again or hold ``c`` on the device through everything between.

The recompute is the layers' own calls on ``c`` with the forward's batch statistics and weight snapshot, so its
values are the forward's, bit for bit, and nothing updates the moving statistics twice.
"""

from __future__ import annotations

from keras_lms.planning import layer_facts
from keras_lms.planning.call_costs import call_cost
from keras_lms.planning.plan import call_graph, tensor_bytes
from keras_lms.planning.recompute import RecomputeSource


def recompute_sources(calls, offloaded, facts, batch_size: int) -> dict:
    """Tensor key -> ``RecomputeSource`` for every tensor the torch back end can recompute (module docstring)."""
    _, consumers = call_graph(calls)
    sources = {}
    for n, call in enumerate(calls):
        if not (len(call.keys) == 1 and len(call.output_keys) == 1 and offloaded[n] and offloaded[n][0]
                and facts.lean_normalization_call(call.unit, call.dtypes)):
            continue
        normalized = call.output_keys[0]
        readers = consumers.get(normalized, [])
        producer, chain = n, [n]
        if len(readers) == 1 and _recomputable_activation(calls[readers[0]], offloaded[readers[0]], facts):
            producer = readers[0]
            chain.append(producer)
        key = calls[producer].output_keys[0]
        if _single_copying_reader(calls, key, producer, consumers.get(key, []), offloaded, facts) is None:
            continue
        size = tensor_bytes(call.shapes[0], call.dtypes[0], batch_size)
        work = sum(call_cost(calls[c], batch_size).forward_bytes for c in chain)
        temporaries = facts.lean_normalization_temporary_bytes(call.shapes[0], call.dtypes[0], batch_size)
        sources[key] = RecomputeSource(key, producer, ((call.keys[0], size),), 1, 0, 0.0, work, exact_rows=True,
                                       shared_reader=n, temporary_bytes=temporaries)
    return sources


def _recomputable_activation(call, offloaded_row, facts) -> bool:
    """An activation layer the offload runs (its output copied for its own gradient), without weights."""
    return (len(call.keys) == 1 and len(call.output_keys) == 1 and any(offloaded_row)
            and facts.output_gradient_activation(call.unit) is not None
            and not getattr(call.unit, "trainable_variables", None)
            and layer_facts.standalone_activation(call.unit) is not None)


def _single_copying_reader(calls, key, producer: int, readers, offloaded, facts):
    """The one call other than ``producer`` that copies ``key`` and reads it in its backward, or None when there
    is none or more than one."""
    copying = [c for c in readers if c != producer and facts.backward_reads(calls[c].unit)[0]
               and any(off for k, off in zip(calls[c].keys, offloaded[c]) if k == key)]
    return copying[0] if len(copying) == 1 else None
