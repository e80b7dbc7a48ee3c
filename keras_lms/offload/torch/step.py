"""The torch step context: decides each intercepted call, swaps its inputs out and schedules the swap-ins."""

from __future__ import annotations

import contextlib
import threading
import weakref

import keras
import torch
from torch.utils.weak import WeakIdKeyDictionary

from keras_lms import _keras_adapter as adapter
from keras_lms.offload import common
from keras_lms.offload.torch import lean_conv, lean_norm, recompute
from keras_lms.offload.torch.devices import validate_host_device
from keras_lms.offload.torch.function import _CallRecord, _OffloadedFunction
from keras_lms.offload.torch.no_recompute import input_gradient_from_output, runs_plainly
from keras_lms.offload.torch.offloader import offloader_for
from keras_lms.offload.torch.rng import _RngState
from keras_lms.offload.torch.tracing import TENSOR_FACTS
from keras_lms.offload.torch.transfer import Transfer, _HostCopy
from keras_lms.planning.plan import deepest_lead, lead_of, tensor_bytes


def swap_in_order(index: int, pending, prefetch) -> list:
    """Which offloaded calls' swap-ins the backward of call ``index`` starts, in the order they are issued.

    ``pending`` holds the calls whose swap-in has not started. The call's own inputs come first (needed now),
    then calls ``index-1 .. index-prefetch`` of the forward pass (their backward runs next, in that order).
    With ``prefetch=0`` a call brings back only its own inputs, when its gradient arrives. ``prefetch`` is one
    depth, or one per call (``plan.planned_leads``): call ``i`` is started by the backward of ``i + its lead``
    (or an earlier one, where that call's backward started nothing: it is pending still).
    """
    order = [index] if index in pending else []
    order += [i for i in range(index - 1, index - deepest_lead(prefetch) - 1, -1)
              if i in pending and i + lead_of(prefetch, i) >= index]
    return order


class StepContext(common.InterceptingContext):
    """State of one forward pass of a wrapped model in training mode (torch).

    Lives as long as the backward pass of that step needs it: every offloaded call's autograd node holds its
    record, which holds this context; the context indexes the records weakly. It runs with the wrapped model's
    ``Offloader`` (the one of ``structure``): that model's pool, counters and settings, fixed for the step.
    """

    def __init__(self, config, structure, plan, eager: bool = True):
        super().__init__(config, structure, plan, eager, host=validate_host_device(config.host_device))
        self.host_copies = WeakIdKeyDictionary()  # device tensor (weakly) -> _HostCopy
        self.records = weakref.WeakValueDictionary()  # call index -> _CallRecord (offloaded calls)
        self.transfers = {}  # device -> Transfer
        self.offloader = offloader_for(structure)
        self.settings = self.offloader.settings()
        self.pool = self.offloader.pool
        self.count = self.offloader.stats.count
        self.pool.new_step()
        self._lock = threading.RLock()
        # recomputed instead of copied (recompute): the planned producers, the BatchNorm records by their output
        # (the activation after one recomputes through it) and the stand-ins swap_out hands out
        self.recomputed_producers = {entry.index for entry in plan if entry.recomputed_output} if plan else set()
        self.normalized_by = WeakIdKeyDictionary()  # BatchNorm output -> its _CallRecord
        self.recomputed = WeakIdKeyDictionary()  # tensor -> RecomputedCopy

    @contextlib.contextmanager
    def forward_scope(self):
        """Around the wrapped model's forward pass: release graph intermediates after their last use, and
        flatten structures without reference cycles (see ``_keras_adapter.acyclic_torch_trees``)."""
        with adapter.releasing_graph_runs(self.structure.models), adapter.acyclic_torch_trees():
            yield

    def transfer(self, device) -> Transfer:
        transfer = self.transfers.get(device)
        if transfer is None:
            transfer = self.transfers[device] = Transfer(
                device, self.pool, copies=self.settings["cpu_host_copies"],
                max_inflight_bytes=self.settings["max_inflight_bytes"], stats=self.offloader.stats)
        return transfer

    # ----------------------------------------------------------------------------------- forward
    def call(self, index, unit, original, args, kwargs):
        tensors = [leaf for leaf in keras.tree.flatten((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        decision = self._decision(index, unit, tensors)
        if not decision.offloaded or not self._needs_graph(unit, tensors) or runs_plainly(unit, kwargs):
            self.count(plain_calls=1)
            return original(*args, **kwargs)
        return self._offloaded_call(index, unit, original, args, kwargs, tensors, decision)

    @staticmethod
    def _needs_graph(unit, tensors) -> bool:
        """Whether autograd would record this call at all (else it keeps nothing and runs plainly)."""
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in tensors):
            return True
        return bool(getattr(unit, "trainable_variables", None))

    @staticmethod
    def tensor_bytes(tensor) -> int:
        return tensor_bytes(tuple(tensor.shape), keras.backend.standardize_dtype(tensor.dtype))

    tensor_rank = staticmethod(TENSOR_FACTS.rank)

    def swap_out(self, tensor) -> _HostCopy:
        """The step's host copy of ``tensor`` (made once, shared by every call that offloads it)."""
        with self._lock:
            recomputed = self.recomputed.get(tensor)
            if recomputed is not None:
                return recomputed  # never copied: recomputed in its reader's backward
            host = self.host_copies.get(tensor)
            if host is None or host.buffer is None:
                host = self.transfer(tensor.device).to_host(tensor)
                self.host_copies[tensor] = host
            return host

    def _offloaded_call(self, index, unit, original, args, kwargs, tensors, decision):
        template, positions = common.template(args, kwargs, TENSOR_FACTS.is_tensor)
        is_layer = isinstance(unit, keras.layers.Layer)
        trainable = list(adapter.raw_values(unit.trainable_variables)) if is_layer else []
        snapshot = list(adapter.raw_values(unit.non_trainable_variables)) if is_layer else []
        masks = [adapter.get_mask(t) for t in tensors]
        act_grad = input_gradient_from_output(unit) if len(tensors) == 1 and not trainable else None
        record = _CallRecord(self, index, unit, original, template, positions, tensors, trainable, snapshot, masks,
                             adapter.current_autocast_dtype(), output_grad=act_grad)
        record.transfer = self.transfer(next((t.device for t in tensors if t.is_cuda), tensors[0].device))
        if act_grad is None:
            record.lean = lean_norm.eligible(unit, self.config, tensors, kwargs)
            record.captures_moments = lean_norm.captures_moments(unit, tensors, kwargs)
            record.lean_conv = lean_conv.eligible(unit, tensors)
            record.rng = _RngState.capture(tensors)
            for j, (t, off) in enumerate(zip(tensors, decision.offload_tensor)):
                if off:
                    host = self.swap_out(t)
                    host.pending += 1
                    record.hosts[j] = host
                else:
                    record.kept[j] = t
        flat_results = _OffloadedFunction.apply(record, *tensors, *trainable)
        outputs, new_state, n_out = record.forward_result
        record.forward_result = None
        tensor_results, losses = list(flat_results[:n_out]), list(flat_results[n_out:])
        inner = iter(leaf for leaf in keras.tree.flatten(outputs) if isinstance(leaf, torch.Tensor))
        results = iter(tensor_results)
        leaves = []
        for leaf in keras.tree.flatten(outputs):
            if isinstance(leaf, torch.Tensor):
                mask = adapter.get_mask(next(inner))
                leaf = next(results)
                adapter.set_mask(leaf, mask)
            leaves.append(leaf)
        outputs = keras.tree.pack_sequence_as(outputs, leaves)
        self._register_recompute(index, record, tensors, tensor_results)
        if act_grad is not None:
            if not tensor_results or tensor_results[0].grad_fn is None:
                act_grad = record.output_grad = None  # nothing will ask for its gradient
            else:
                host = self.swap_out(tensor_results[0])
                host.pending += 1
                host.output_pending += 1
                record.output_host = host
                self.count(output_gradient_calls=1)
        for loss in losses:
            unit.add_loss(loss)
        if is_layer:
            for j, (var, old, new) in enumerate(zip(unit.non_trainable_variables, snapshot, new_state)):
                if new is not old:
                    # assign() copies in place into the tensor the snapshot holds: keep the old value.
                    record.snapshot[j] = old.detach().clone()
                    var.assign(new)
        self.records[index] = record
        self.count(offloaded_calls=1)
        return outputs

    def _register_recompute(self, index, record, tensors, results):
        """A BatchNorm's output, or an activation's after one, that the plan recomputes: ``swap_out`` hands out a
        ``RecomputedCopy`` for it from now on (when the records hold what it needs; else it is copied)."""
        if record.moments is not None and len(results) == 1:
            self.normalized_by[results[0]] = record
        if index not in self.recomputed_producers or len(results) != 1:
            return
        if record.moments is not None:
            norm, activation = record, None
        else:
            norm, activation = self.normalized_by.get(tensors[0]) if len(tensors) == 1 else None, record
        if recompute.usable(norm, activation):
            self.recomputed[results[0]] = recompute.RecomputedCopy(norm, activation, self.tensor_bytes(results[0]))

    # ---------------------------------------------------------------------------------- backward
    def begin_backward(self, record):
        """Start this call's swap-in (if not prefetched) and those of the calls whose lead reaches it (the next
        ``prefetch`` calls, or as ``PlanEntry.copy_back_lead`` says)."""
        with self._lock:
            candidates = {i: self.records.get(i) for i in range(record.index - deepest_lead(self.leads), record.index)}
            candidates[record.index] = record
            pending = {i for i, r in candidates.items() if r is not None and not r.started}
            for i in swap_in_order(record.index, pending, self.leads):
                candidates[i].start_swap_in()

    def end_backward(self, record):
        with self._lock:
            if self.records.get(record.index) is record:
                del self.records[record.index]
