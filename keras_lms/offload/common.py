"""What the back ends' offload modules share: the step context's state and per-call decision, the planning
trace's call recorder, argument templates, example inputs, and which units cannot be offloaded."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Callable

import keras

from keras_lms import _keras_adapter as adapter
from keras_lms.planning import rules
from keras_lms.planning.plan import CallDecision, RawCall, planned_leads

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
        return CallDecision(list(entry.tensor_offloaded), entry.reason, entry.slab_bytes, entry.recompute_from,
                            entry.sweep, entry.sweep_windows, entry.sweep_held, entry.sweep_folded,
                            entry.folded_pooling, entry.slab_align)
    if not ctx.mismatch_warned:
        ctx.mismatch_warned = True
        log.warning(
            "keras-lms: layer call %d (%s) differs from the planned forward pass (the model's call order "
            "depends on its inputs); deciding this step's remaining calls without keep_last.", index, unit.name,
        )
    return rules.decide(ctx.config, unit, ctx.structure.unit_models.get(id(unit), []), index, None, sizes, ranks,
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


def offloadable_reason(unit, foreign=None) -> str | None:
    """Why the back end cannot offload this unit's calls, or None if it can.

    ``foreign`` lists what the planning trace found out about the unit: the paths of variables of other layers
    (tied weights) it reads, on a back end whose offloaded call takes only the unit's own variables
    (``CallRecorder(foreign_reads=...)``: torch's recompute returns gradients only for them, JAX's ``custom_vjp``
    sees only them). The trace keeps the finding on the plan (``PlanEntry.unoffloadable``), not on the model's
    structure, which is read-only.
    """
    if adapter.is_quantized(unit):
        return "quantized layers are not intercepted (they run quantized_call)"
    if foreign:
        return (f"reads {'trainable ' if foreign.trainable_only else ''}variables of other layers "
                f"({', '.join(foreign)}); the offloaded call takes only the layer's own variables, so the call "
                "runs plainly")
    return None


class ForeignReads(list):
    """Paths of the variables of other layers a call read (a list), and whether only trainable ones count."""

    def __init__(self, paths, trainable_only: bool):
        super().__init__(paths)
        self.trainable_only = trainable_only


def foreign_trainable_reads(unit, variables) -> ForeignReads:
    """The trainable variables among ``variables`` that ``unit`` does not own (e.g. a tied projection's kernel):
    torch's recompute reads every variable's current value, but returns gradients only for the unit's own."""
    own = {id(v) for v in getattr(unit, "trainable_variables", [])}
    return ForeignReads([v.path for v in variables if getattr(v, "trainable", False) and id(v) not in own], True)


def foreign_variable_reads(unit, variables) -> ForeignReads:
    """Every variable among ``variables`` that ``unit`` does not own: JAX's offloaded call maps only the unit's own
    variables to the step's traced values (another layer's would read a stale or purged value)."""
    own = {id(v) for v in getattr(unit, "variables", [])}
    return ForeignReads([v.path for v in variables if id(v) not in own], False)


_HOST_RE = re.compile(r"^/?(?:device:)?(cpu)(?::(\d+))?$", re.IGNORECASE)


def single_host_device(host_device: str, accelerators: str, absent: str) -> str:
    """Resolve ``host_device`` to '/CPU:0' on a back end with one host (torch, JAX), or raise one clear error:
    not a string, an accelerator (``accelerators``: a regex of its names) or another CPU (``absent`` says why
    there is none)."""
    if not isinstance(host_device, str):
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    match = _HOST_RE.match(host_device.strip())
    if match is None:
        if re.match(rf"^/?(?:device:)?({accelerators})", host_device.strip(), re.IGNORECASE):
            raise ValueError(
                f"host_device={host_device!r} is not a CPU device. keras-lms offloads activations to host memory; "
                "use '/CPU:0'."
            )
        raise ValueError(f"host_device={host_device!r} is not a device string; use e.g. '/CPU:0'.")
    if int(match.group(2) or 0) != 0:
        raise ValueError(f"host_device={host_device!r} does not exist {absent}; available: /CPU:0.")
    return "/CPU:0"


XLA_MESSAGE = (
    "keras-lms cannot run under XLA on this back end: jit_compile=True ignores the explicit host placement that "
    "offloading relies on, so activations would silently stay on the device. Compile the wrapped model with "
    "jit_compile=False (jit_compile='auto' is resolved to False for wrapped models)."
)


def without_xla(jit_compile) -> bool:
    """``resolve_jit_compile`` of a back end whose offload XLA would undo (TensorFlow, torch): always False."""
    if jit_compile is True:
        raise ValueError(XLA_MESSAGE)
    if jit_compile not in ("auto", False):
        raise ValueError(f"jit_compile must be False or 'auto' for a wrapped model; got {jit_compile!r}.")
    return False


class DeviceStatsUnavailable(RuntimeError):
    """The back end's allocator keeps no statistics for a device (``keras_lms.memory`` warns once and reads NaN).

    ``hint`` says how to get them, or is empty.
    """

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """How a back end reads its tensors: which leaves are tensors, and a tensor's shape, dtype name and rank."""

    is_tensor: Callable  # value -> bool
    shape: Callable  # tensor -> list of dims (None where unknown)
    dtype: Callable  # tensor -> dtype name, e.g. "float32"
    rank: Callable  # tensor -> int
    flatten: Callable = keras.tree.flatten  # structure -> leaves, in the order the back end flattens

    def tensors(self, structure) -> list:
        return [leaf for leaf in self.flatten(structure) if self.is_tensor(leaf)]


def spec_of(value, facts: TensorFacts):
    """A KerasTensor standing in for ``value`` when it is one of the back end's tensors, else ``value``."""
    if facts.is_tensor(value):
        return keras.KerasTensor(tuple(facts.shape(value)), facts.dtype(value))
    return value


def signature_of(inputs, kwargs, facts: TensorFacts):
    """Hashable key of a call's tensor (or KerasTensor) shapes and dtypes: one plan per input signature."""
    out = []
    for leaf in keras.tree.flatten((inputs, kwargs)):
        if facts.is_tensor(leaf):
            out.append((tuple(facts.shape(leaf)), facts.dtype(leaf)))
        elif isinstance(leaf, keras.KerasTensor):
            out.append((tuple(leaf.shape), keras.backend.standardize_dtype(leaf.dtype)))
        else:
            out.append(repr(leaf))
    return tuple(out)


class CallRecorder:
    """The planning trace's stand-in for every unit's ``call``: runs it and notes a ``RawCall`` (shapes).

    ``make_wrapper`` goes to ``_keras_adapter.patched_calls``; ``calls`` lists the unit calls in forward order.
    The traced tensors are held until the trace ends, so their ``id`` (a call's ``keys``) is unique within it.
    """

    def __init__(self, structure, facts: TensorFacts, foreign_reads: Callable | None = None):
        self.structure, self.facts = structure, facts
        self.foreign_reads = foreign_reads  # (unit, variables read) -> ForeignReads, or None: not recorded
        self.calls, self._held = [], []

    def clear(self) -> None:
        """Forget what was recorded (a trace that is run again from the start)."""
        self.calls.clear()
        self._held.clear()

    def make_wrapper(self, unit, original):
        facts = self.facts

        def recording_call(*args, **kw):
            tensors = facts.tensors((args, kw))
            foreign = None
            if self.foreign_reads is not None:
                with adapter.recording_variable_reads() as read:
                    outputs = original(*args, **kw)
                foreign = self.foreign_reads(unit, read)
            else:
                outputs = original(*args, **kw)
            outs = facts.tensors(outputs)
            self._held.extend(tensors + outs)
            self.calls.append(RawCall(
                unit=unit,
                enclosing=self.structure.unit_models.get(id(unit), []),
                shapes=[facts.shape(t) for t in tensors],
                dtypes=[facts.dtype(t) for t in tensors],
                ranks=[facts.rank(t) for t in tensors],
                keys=[id(t) for t in tensors],
                output_shapes=[facts.shape(t) for t in outs],
                output_dtypes=[facts.dtype(t) for t in outs],
                offloadable=offloadable_reason(unit, foreign),
                output_keys=[id(t) for t in outs],
            ))
            return outputs

        return recording_call


def example_inputs(model, batch_size: int, spec_for, map_structure=keras.tree.map_structure):
    """Placeholder specs (made by ``spec_for(shape, dtype)``) for a built model's inputs at ``batch_size``, or
    None when the model does not say its input shape."""
    declared = declared_inputs(model)
    if declared is not None:
        return map_structure(lambda kt: spec_for([batch_size] + list(kt.shape[1:]), kt.dtype), declared)
    build = model.get_build_config() if hasattr(model, "get_build_config") else None
    shape = (build or {}).get("input_shape")
    if shape is None or not isinstance(shape, (list, tuple)) or not shape or isinstance(shape[0], (list, tuple, dict)):
        return None
    return spec_for([batch_size] + list(shape[1:]), "float32")


class InterceptingContext:
    """Base of the back ends' StepContext: the step's settings and plan, and each intercepted unit call,
    numbered in forward order, handed to ``self.call(index, unit, original, args, kwargs)``.

    ``host`` is the resolved host device; a subclass adds its caches and says how big a tensor is
    (``tensor_bytes``) and what its rank is (``tensor_rank``).
    """

    index = 0

    def __init__(self, config, structure, plan, eager: bool, host: str):
        self.config = config
        self.structure = structure
        self.plan = plan  # list[PlanEntry] for this input signature
        # how many calls ahead copies back start: the planner's depth where it chose one (PlanEntry.prefetch), or
        # one per call where it started some earlier (PlanEntry.copy_back_lead); ``plan.lead_of`` reads either
        self.leads = planned_leads(plan, config.prefetch)
        self.eager = eager
        self.host = host
        self.index = 0
        self.mismatch_warned = False
        # what the planning trace found the back end cannot offload (for calls that differ from the plan)
        self.unoffloadable = {entry.layer: entry.unoffloadable for entry in plan if entry.unoffloadable}

    @staticmethod
    def tensor_bytes(tensor) -> int:
        raise NotImplementedError

    @staticmethod
    def tensor_rank(tensor) -> int:
        raise NotImplementedError

    def _decision(self, index, unit, tensors):
        """The plan's decision for call ``index`` of ``unit`` on ``tensors`` (see ``planned_decision``)."""
        sizes = [self.tensor_bytes(t) for t in tensors]
        ranks = [self.tensor_rank(t) for t in tensors]
        reason = offloadable_reason(unit) or self.unoffloadable.get(unit.name)
        return planned_decision(self, index, unit, sizes, ranks, reason)

    def forward_scope(self):
        """A context manager around the wrapped model's forward pass; none by default."""
        return contextlib.nullcontext()

    def make_wrapper(self, unit, original):
        def intercepted_call(*args, **kwargs):
            index = self.index
            self.index += 1
            return self.call(index, unit, original, args, kwargs)

        return intercepted_call


@contextlib.contextmanager
def given_moments(unit, moments):
    """Within the block, BatchNormalization's batch statistics are ``moments(inputs)`` (None: its own): a
    recompute normalises with the forward's statistics (both back ends' recomputes)."""
    hook = adapter.batchnorm_moments_hook(unit)
    if moments is None or hook is None:
        yield
        return
    with adapter.patched_attribute(unit, hook, lambda inputs, mask: moments(inputs)):
        yield


def no_training_call_scope() -> None:
    """``Backend.training_call_scope`` of a back end whose train function needs no scope (torch, JAX)."""
    return None


def called_in_scope(function, scope):
    """``function`` (a train function), each call inside the context manager ``scope()`` returns (none where it
    returns None); ``function`` itself where it is None or already scoped (``make_train_function`` returns the
    function it made before)."""
    if function is None or getattr(function, "lms_scoped", False):
        return function

    def scoped(*args, **kwargs):
        context = scope()
        if context is None:
            return function(*args, **kwargs)
        with context:
            return function(*args, **kwargs)

    scoped.lms_scoped = True
    return scoped
