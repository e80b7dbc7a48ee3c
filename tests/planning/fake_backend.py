"""A third back end, for tests: a module that implements the back-end contract (`keras_lms.offload.Backend`)
without tensors, so that planning, the report and the wrapper can be run on something that is neither
TensorFlow nor torch.

Its planning trace reads a Functional model's symbolic graph (each layer's `input` and `output` KerasTensors)
instead of running the model, and its step context runs every call plainly. What its training step holds is
`FakeFacts`, a `BackendFacts` with facts of its own: the planner must use them without knowing this back end.
"""

from __future__ import annotations

import contextlib

import keras

from keras_lms.offload.common import DeviceStatsUnavailable
from keras_lms.planning import BackendFacts, RawCall

HOST = "/fake:host"


class FakeFacts(BackendFacts):
    """Differentiates relu from its output, recomputes every offloaded call and keeps a whole-step extra buffer."""

    output_gradient_activations = frozenset({"relu"})
    recomputes_offloaded_calls = True
    STATIC_EXTRA = 12345

    def static_extra_bytes(self, model, optimizer=None, default_slots: int = 2) -> int:
        return self.STATIC_EXTRA


FACTS = FakeFacts()


def memory_facts() -> BackendFacts:
    return FACTS


class StepContext:
    """Runs every layer call plainly (this back end moves nothing)."""

    def __init__(self, config, structure, plan, eager: bool):
        self.config, self.structure, self.plan = config, structure, plan

    def make_wrapper(self, unit, original):
        return original

    def forward_scope(self):
        return contextlib.nullcontext()


def validate_host_device(host_device: str) -> str:
    return HOST


def resolve_jit_compile(jit_compile) -> bool:
    return jit_compile is True


def executing_eagerly() -> bool:
    return True


def _tensors(value) -> list:
    return [t for t in keras.tree.flatten(value) if isinstance(t, keras.KerasTensor)]


def signature_of(inputs, kwargs):
    return tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, keras.KerasTensor) else repr(t)
                 for t in keras.tree.flatten((inputs, kwargs)))


def trace_calls(model, structure, inputs, kwargs) -> list:
    """One RawCall per layer of a Functional model, in its graph's order, from the layers' symbolic tensors."""
    calls = []
    for unit in structure.units:
        ins, outs = _tensors(unit.input), _tensors(unit.output)
        calls.append(RawCall(
            unit=unit, enclosing=structure.unit_models.get(id(unit), []),
            shapes=[list(t.shape) for t in ins], dtypes=[str(t.dtype) for t in ins], ranks=[len(t.shape) for t in ins],
            keys=[id(t) for t in ins], output_shapes=[list(t.shape) for t in outs],
            output_dtypes=[str(t.dtype) for t in outs], offloadable=offloadable_reason(unit),
            output_keys=[id(t) for t in outs]))
    return calls


def example_inputs(model, batch_size: int):
    return [spec_for([batch_size, *t.shape[1:]], t.dtype) for t in model.inputs]


def spec_for(shape, dtype):
    return keras.KerasTensor(tuple(shape), dtype)


def offloadable_reason(unit) -> str | None:
    return None


def input_gradient_from_output(unit):
    return None


def default_device() -> str:
    return "/fake:0"


def training_call_scope():
    return None


def reset_device_peak(device: str) -> None:
    raise DeviceStatsUnavailable("the fake back end has no allocator")


def device_peak_bytes(device: str) -> int | None:
    return None
