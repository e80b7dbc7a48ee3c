"""What the back ends' offload modules share: argument templates and the planned decision for a call."""

from __future__ import annotations

import logging

import keras

from keras_lms import policy

log = logging.getLogger(__name__)


def template(args, kwargs, is_tensor):
    """(args, kwargs) with every tensor replaced by None, and the tensors' positions among the leaves.

    Closures and records keep the template, never the forward tensors themselves.
    """
    leaves = keras.tree.flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_tensor(leaf)]
    blank = [None if is_tensor(leaf) else leaf for leaf in leaves]
    return keras.tree.pack_sequence_as((args, kwargs), blank), positions


def rebuild(template_, positions, tensors):
    """(args, kwargs) from a template with ``tensors`` put back at ``positions``."""
    leaves = keras.tree.flatten(template_)
    for pos, tensor in zip(positions, tensors):
        leaves[pos] = tensor
    return keras.tree.pack_sequence_as(template_, leaves)


def planned_decision(ctx, index, unit, sizes, ranks, offloadable):
    """The plan's decision for call ``index``; if the call does not match the plan, decide it on the spot.

    A model whose call sequence depends on its inputs can differ from the planning trace: then the remaining
    calls of the step are decided without keep_last (the total is unknown), with one warning per step.
    """
    entry = ctx.plan[index] if index < len(ctx.plan) else None
    if entry is not None and entry.layer == unit.name and len(entry.tensor_offloaded) == len(sizes):
        return policy.CallDecision(list(entry.tensor_offloaded), entry.reason)
    if not ctx.mismatch_warned:
        ctx.mismatch_warned = True
        log.warning(
            "keras-lms: layer call %d (%s) differs from the planned forward pass (the model's call order "
            "depends on its inputs); deciding this step's remaining calls without keep_last.", index, unit.name,
        )
    return policy.decide(ctx.config, unit, ctx.structure.unit_models.get(id(unit), []), index, None, sizes, ranks,
                         offloadable)


def declared_inputs(model):
    """The model's symbolic inputs in the structure its ``call`` takes, or None when it declares none.

    ``model.input`` raises on a Sequential built with ``keras.Input`` that was never called, although its
    ``inputs`` are known; fall back to those.
    """
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return None
    try:
        return model.input
    except (AttributeError, ValueError):
        return inputs[0] if len(inputs) == 1 else list(inputs)


class InterceptingContext:
    """Base of the back ends' StepContext: hands each intercepted unit call, numbered in forward order, to
    ``self.call(index, unit, original, args, kwargs)``."""

    index = 0

    def make_wrapper(self, unit, original):
        def intercepted_call(*args, **kwargs):
            index = self.index
            self.index += 1
            return self.call(index, unit, original, args, kwargs)

        return intercepted_call
