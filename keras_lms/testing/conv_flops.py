"""Convolution FLOPs of a graph as grappler optimised it: what the device really computes, recompute included.

Issue 26 asks for the recompute a plan costs to be counted from the ops that run, not from the model: slab halos
and recomputed windows are extra convolution work that only shows in the executed graph. ``convolution_flops``
sums, over the convolution ops placed on one device (forward, input gradient and filter gradient, 2-D and 3-D),
2 x (output positions of the forward convolution) x (filter elements): each of a forward's output positions
takes ``prod(kernel) * C_in * C_out`` multiply-adds, and both gradients take the same number. Shapes come from
grappler's shape inference on the optimised graph (``Item.GetOpProperties``), so grappler's layout changes
(NDHWC -> NCDHW on a GPU) do not matter: a filter is always ``[kernel..., C_in, C_out]``, and the positions are
the forward output's elements divided by ``C_out``.

Where grappler's inference loses a shape (a slab window of the model's input: the slice's bound constants are
merged with others and its output becomes symbolic), the shapes the op had when it was traced are used
(``traced_convolution_shapes``; grappler keeps convolution nodes' names). Ops known in neither are counted
apart, never guessed.

The wrapped step's figure minus the plain step's is the plan's recompute in convolution FLOPs, independent of
``keras_lms.planning``'s own count (``StepTime.recompute_flops``).
"""

from __future__ import annotations

import math

# op -> (index of the filter among the inputs or -1 for the op's output, index of the forward output (or its
# gradient) among the inputs or -1 for the op's output)
_CONVOLUTIONS = {
    "Conv2D": (1, -1),
    "Conv3D": (1, -1),
    "_FusedConv2D": (1, -1),
    "_FusedConv3D": (1, -1),
    "Conv2DBackpropInput": (1, 2),
    "Conv2DBackpropInputV2": (1, 2),
    "Conv3DBackpropInputV2": (1, 2),
    "Conv2DBackpropFilter": (-1, 2),
    "Conv2DBackpropFilterV2": (-1, 2),
    "Conv3DBackpropFilterV2": (-1, 2),
}


def _shape(props, tensor: str):
    """Static shape of ``tensor`` ("node" or "node:i") from grappler's properties, or None if unknown."""
    name, _, index = tensor.partition(":")
    outputs = props.get(name)
    if not outputs:
        return None
    i = int(index or 0)
    if i >= len(outputs) or outputs[i].shape.unknown_rank:
        return None
    dims = [d.size for d in outputs[i].shape.dim]
    return None if any(d < 0 for d in dims) else dims


def traced_convolution_shapes(func_graph) -> dict:
    """Convolution op name -> (input shapes, output shapes) of a traced graph (lists of ints, None if unknown)."""

    def dims(tensor):
        shape = tensor.shape
        if shape.rank is None or any(d is None for d in shape.as_list()):
            return None
        return shape.as_list()

    return {op.name: ([dims(t) for t in op.inputs], [dims(t) for t in op.outputs])
            for op in func_graph.get_operations() if op.type in _CONVOLUTIONS}


def convolution_flops(graph_def, item, device: str, traced_shapes=None) -> tuple:
    """(FLOPs, convolution ops counted, convolution ops whose shapes were unknown) on ``device``;
    ``traced_shapes`` (``traced_convolution_shapes``) is the fallback for shapes grappler lost."""
    props = item.GetOpProperties()
    traced_shapes = traced_shapes or {}
    flops, counted, unknown = 0.0, 0, 0
    for node in graph_def.node:
        if node.op not in _CONVOLUTIONS or node.device != device:
            continue
        filter_at, output_at = _CONVOLUTIONS[node.op]
        data = [i for i in node.input if not i.startswith("^")]
        filter_shape = _shape(props, node.name if filter_at < 0 else data[filter_at])
        output_shape = _shape(props, node.name if output_at < 0 else data[output_at])
        if (not filter_shape or not output_shape) and node.name in traced_shapes:
            inputs, outputs = traced_shapes[node.name]
            filter_shape = outputs[0] if filter_at < 0 else inputs[filter_at]
            output_shape = outputs[0] if output_at < 0 else inputs[output_at]
        if not filter_shape or not output_shape or filter_shape[-1] <= 0:
            unknown += 1
            continue
        positions = math.prod(output_shape) / filter_shape[-1]
        flops += 2.0 * positions * math.prod(filter_shape)
        counted += 1
    return flops, counted, unknown
