"""Read a traced training step: which forward tensors the backward pass reads, and where they live."""

import dataclasses

import tensorflow as tf

MARKER = "lms_test_backward_starts_here"


def base_name(op) -> str:
    return op.name.rsplit("/", 1)[-1]


@dataclasses.dataclass
class StepGraph:
    graph: tf.Graph
    forward_ops: list
    backward_ops: list

    def backward_reads(self, min_rank=2):
        """Forward tensors (rank >= min_rank, not variable reads or constants) read by backward ops."""
        forward = set(id(op) for op in self.forward_ops)
        reads = {}
        for op in self.backward_ops:
            for t in op.inputs:
                if id(t.op) in forward and t.shape.rank is not None and t.shape.rank >= min_rank:
                    if t.op.type in ("ReadVariableOp", "Const") or t.op.name.startswith("dy"):
                        continue
                    reads[t.name] = t
        return list(reads.values())

    def ops_named(self, prefix):
        return [op for op in self.graph.get_operations() if base_name(op).startswith(prefix)]


def trace_step(model, x):
    """Trace forward + backward of ``model(x, training=True)``; the backward starts at a marker op."""
    out_spec = tf.nest.map_structure(lambda o: tf.TensorSpec(o.shape, o.dtype), model(x, training=False))

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
        tf.no_op(name=MARKER)
        return tape.gradient(out, model.trainable_variables, output_gradients=dy)

    x_spec = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, a.dtype), x)
    graph = step.get_concrete_function(x_spec, out_spec).graph
    ops = graph.get_operations()
    cut = next(i for i, op in enumerate(ops) if base_name(op) == MARKER)
    return StepGraph(graph, ops[:cut], ops[cut + 1:])


def ancestors(op, include_control=True):
    """Every op that must run before ``op`` (data and control edges)."""
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        parents = [t.op for t in cur.inputs] + (list(cur.control_inputs) if include_control else [])
        for parent in parents:
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen
