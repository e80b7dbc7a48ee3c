"""One offloaded call on torch: the ``torch.autograd.Function`` and the record of what its backward needs."""

from __future__ import annotations

import contextlib

import keras
import torch

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.torch import lean_conv, lean_norm


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _OffloadedFunction(torch.autograd.Function):
    """One offloaded layer call; the non-tensor first argument carries everything (a :class:`_CallRecord`)."""

    @staticmethod
    def forward(ctx, record, *flat):
        ctx.set_materialize_grads(False)
        ctx.record = record
        return record.forward(flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        record = ctx.record
        return (None, *record.backward(grads))


class _CallRecord:
    """What the backward pass of one offloaded call needs: host copies, small kept tensors, the snapshot."""

    def __init__(self, step, index, unit, original, template, positions, tensors, trainable, snapshot, masks,
                 autocast, output_grad=None):
        self.step = step
        self.index = index
        self.unit = unit
        self.original = original
        self.template = template
        self.positions = positions
        self.n_inputs = len(tensors)
        self.trainable = trainable
        self.snapshot = snapshot
        self.masks = masks
        self.autocast = autocast
        self.output_grad = output_grad  # fn(y, dy) for activation layers (output-based gradient)
        self.hosts = [None] * len(tensors)  # _HostCopy per offloaded input
        self.kept = [None] * len(tensors)  # device tensors kept as they are (small or not offloaded)
        self.output_host = None  # the activation's output host copy (output-based gradient)
        self.swaps = None  # id(_HostCopy) -> _SwapIn, once started
        self.started = False
        self.finished = False
        self.forward_result = None
        self.transfer = None  # the Transfer of the call's device
        self.rng = None  # torch's global RNG states before the forward call (unseeded Dropout draws from them)
        self.lean = False  # BatchNormalization: differentiate with the fused kernel from the captured statistics
        self.captures_moments = False  # BatchNormalization: keep the forward's batch statistics (lean, recompute)
        self.moments = None  # (mean, variance) of a BatchNormalization call's forward once captured, else None
        self.lean_conv = False  # a convolution differentiated without recompute (lean_conv)

    # ------------------------------------------------------------------------------------- forward
    def forward(self, flat):
        xs, values = list(flat[:self.n_inputs]), list(flat[self.n_inputs:])
        for x, mask in zip(xs, self.masks):
            adapter.set_mask(x, mask)
        args, kwargs = common.rebuild(self.template, self.positions, xs)
        # the batch statistics, for the lean backward and for recomputing the output (recompute)
        capture = (lean_norm.capturing_moments(self.unit, self, xs[0]) if self.captures_moments
                   else contextlib.nullcontext())
        with capture:
            outputs, new_state, losses = adapter.run_stateless(self.unit, self.original, values, self.snapshot,
                                                               args, kwargs, self.autocast)
        leaves = keras.tree.flatten(outputs)
        tensor_out = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.forward_result = (outputs, new_state, len(tensor_out))
        return tuple(tensor_out) + tuple(losses)

    # ------------------------------------------------------------------------------------ backward
    def host_copies(self):
        hosts = [h for h in self.hosts if h is not None]
        if self.output_host is not None:
            hosts.append(self.output_host)
        return hosts

    def start_swap_in(self):
        """Issue this call's host-to-device copies (idempotent); shares a copy already on the device."""
        if self.started:
            return
        self.started = True
        self.swaps = {}
        shared = set()
        for host in self.host_copies():
            if id(host) in self.swaps:
                continue
            swap = host.resident
            if swap is not None:
                self.step.count(shared_swap_ins=1)
                shared.add(id(host))
            else:
                swap = host.bring_back(self.transfer)  # a copy back, or a recompute (recompute.RecomputedCopy)
                others = host.output_pending - (1 if host is self.output_host else 0)
                if others > 0:
                    host.resident = swap  # an activation layer's backward reads it right after ours
            self.swaps[id(host)] = swap
        for host in self.host_copies():
            host.done(output_reader=host is self.output_host, shared=id(host) in shared)

    def backward(self, grads):
        if self.finished:
            raise RuntimeError(
                "keras-lms: the backward pass of an offloaded layer call ran twice. A wrapped model's training step "
                "supports one backward pass per forward pass (no retain_graph=True)."
            )
        self.finished = True
        step = self.step
        step.begin_backward(self)
        try:
            if self.output_grad is not None:
                y = self.swaps[id(self.output_host)].get()
                dy = grads[0]
                dx = None if dy is None else self.output_grad(y, dy)
                return [dx] + [None] * (self.n_inputs - 1) + [None] * len(self.trainable)
            if self.lean and self.moments is not None:
                return self._lean_vjp(grads)
            if self.lean_conv:
                return self._lean_conv_vjp(grads)
            return self._recompute_vjp(grads)
        finally:
            self.swaps = None
            self.kept = [None] * self.n_inputs
            self.trainable = self.snapshot = self.moments = None
            step.end_backward(self)

    def _lean_vjp(self, grads):
        """BatchNormalization without the recompute: torch's fused gradient kernel (``lean_norm``)."""
        host, kept = self.hosts[0], self.kept[0]
        x = kept if host is None else self.swaps[id(host)].get()
        if grads[0] is None:
            return [None] * (1 + len(self.trainable))
        self.step.count(lean_normalization_calls=1)
        dx, param_grads = lean_norm.backward(self.unit, x, grads[0], self.trainable, self.moments)
        return [dx] + param_grads

    def _lean_conv_vjp(self, grads):
        """A convolution without the recompute: ``aten.convolution_backward`` on the swapped-in input."""
        host, kept = self.hosts[0], self.kept[0]
        x = kept if host is None else self.swaps[id(host)].get()
        if grads[0] is None:
            return [None] * (1 + len(self.trainable))
        self.step.count(lean_convolution_calls=1)
        dx, param_grads = lean_conv.backward(self.unit, x, grads[0], self.trainable, self.autocast)
        return [dx] + param_grads

    def _recompute_vjp(self, grads):
        xs = []
        for host, kept in zip(self.hosts, self.kept):
            xs.append(kept if host is None else self.swaps[id(host)].get())
        with torch.enable_grad(), self.rng.restored(), adapter.acyclic_torch_trees():
            xs = [x.detach().requires_grad_(True) if _is_float(x) else x.detach() for x in xs]
            params = [p.detach().requires_grad_(True) for p in self.trainable]
            for x, mask in zip(xs, self.masks):
                adapter.set_mask(x, mask)
            args, kwargs = common.rebuild(self.template, self.positions, xs)
            outputs, _, losses = adapter.run_stateless(self.unit, self.original, params, self.snapshot, args, kwargs,
                                                       self.autocast)
            targets = [t for t in keras.tree.flatten(outputs) if isinstance(t, torch.Tensor)] + list(losses)
            pairs = [(t, g) for t, g in zip(targets, grads) if g is not None and t.requires_grad]
            sources = [x for x in xs if _is_float(x)] + params
            if pairs and sources:
                source_grads = torch.autograd.grad([t for t, _ in pairs], sources, [g for _, g in pairs],
                                                   allow_unused=True)
            else:
                source_grads = [None] * len(sources)
        source_grads = iter(source_grads)
        input_grads = [next(source_grads) if _is_float(x) else None for x in xs]
        return input_grads + list(source_grads)
