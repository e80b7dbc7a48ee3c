"""The back-end contract (`keras_lms.offload.Backend`): the active back end's offload module provides every member
with a compatible signature, the checker rejects a module that does not (negative controls), and the rest of
keras-lms reaches the back end only through the contract. Backend-neutral: the
suite runs it under each back end."""

from __future__ import annotations

import ast
import contextlib
import pathlib
import types

import keras
import pytest

from keras_lms import memory, offload, planning

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "keras_lms"


def _copy(module, **changes) -> types.ModuleType:
    """A stand-in module with the members of `module`, some replaced (a value) or removed (None)."""
    fake = types.ModuleType(f"fake_{module.__name__}")
    fake.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    for name, value in changes.items():
        if value is None:
            delattr(fake, name)
        else:
            setattr(fake, name, value)
    return fake


def test_active_backend_is_the_keras_backend():
    module = offload.active_backend()
    assert module.__name__ == f"keras_lms.offload.{keras.backend.backend()}"
    assert offload.active_backend() is module


def test_active_backend_satisfies_the_contract():
    module = offload.active_backend()
    assert offload.contract_problems(module) == []
    members = set(offload._members(offload.Backend))
    assert {"validate_host_device", "StepContext", "executing_eagerly", "signature_of", "trace_calls",
            "example_inputs", "spec_for", "offloadable_reason", "input_gradient_from_output", "default_device",
            "reset_device_peak", "device_peak_bytes", "memory_facts"} <= members
    assert issubclass(module.StepContext, offload.StepContextLike)
    assert isinstance(module.memory_facts(), planning.BackendFacts)


@pytest.mark.parametrize("missing", ["trace_calls", "validate_host_device", "StepContext", "device_peak_bytes"])
def test_a_module_missing_a_member_fails(missing):
    """Negative control: the check names each member a module lacks."""
    problems = offload.contract_problems(_copy(offload.active_backend(), **{missing: None}))
    assert f"{missing}: missing" in problems, problems


def test_an_incompatible_signature_fails():
    """Negative control: a member that cannot be called as the contract says is reported, with its reason."""
    backend = offload.active_backend()

    def example_inputs(model):  # no batch_size
        return None

    def signature_of(inputs, kwargs, cache):  # an extra parameter without a default
        return ()

    def spec_for(dims, dtype):  # another name
        return None

    problems = offload.contract_problems(_copy(backend, example_inputs=example_inputs, signature_of=signature_of,
                                               spec_for=spec_for))
    assert any(p.startswith("example_inputs: takes no parameter 'batch_size'") for p in problems), problems
    assert any(p.startswith("signature_of: extra parameter") for p in problems), problems
    assert any(p.startswith("spec_for: parameter 0 is 'dims'") for p in problems), problems
    assert len(problems) == 3, problems

    def validate_host_device(host_device, strict=False):  # extra parameters with defaults are compatible
        return host_device

    assert offload.contract_problems(_copy(backend, validate_host_device=validate_host_device)) == []


def test_a_step_context_without_forward_scope_fails():
    """Negative control: the step context class is checked against `StepContextLike` too."""
    backend = offload.active_backend()

    class Bare:
        def __init__(self, config, structure, plan, eager):
            pass

        def make_wrapper(self, unit, original):
            return original

    assert "StepContext.forward_scope: missing" in offload.contract_problems(_copy(backend, StepContext=Bare))
    Bare.forward_scope = contextlib.nullcontext
    assert offload.contract_problems(_copy(backend, StepContext=Bare)) == []


def test_another_keras_backend_is_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(NotImplementedError, match="KERAS_BACKEND is 'numpy'. Set KERAS_BACKEND=tensorflow, torch"):
        offload.active_backend()
    assert memory.default_device() == "cpu" and memory.device_peak_bytes("cpu") is None  # no reading there


def test_memory_reads_the_device_through_the_backend(monkeypatch):
    backend = offload.active_backend()
    assert memory.default_device() == backend.default_device()
    monkeypatch.setattr(backend, "device_peak_bytes", lambda device: 1234)
    assert memory.device_peak_bytes("any") == 1234


def _backend_uses(path: pathlib.Path) -> set:
    """Names read from the back end in a module: `backend.X` and `self._offload.X`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id == "backend":
            used.add(node.attr)
        elif isinstance(value, ast.Attribute) and value.attr == "_offload":
            used.add(node.attr)
    return used


def test_the_rest_of_the_package_uses_only_the_contract():
    """model, report and memory reach the back end through `offload.active_backend()` and its contract only, and
    planning through the back end it is given (`plan_step(backend, ...)`)."""
    members = set(offload._members(offload.Backend))
    for name in ("model.py", "report.py", "memory.py", "planning/step.py"):
        path = PACKAGE / name
        used = _backend_uses(path)
        assert used, f"{name} reads nothing from the back end: has the check lost track of it?"
        assert used <= members, f"{name} uses {sorted(used - members)} outside keras_lms.offload.Backend"
        text = path.read_text()
        assert "offload.active_backend()" in text or name.startswith("planning/"), name
        assert "keras.backend.backend()" not in text, f"{name} switches on the back end itself"
        assert "from keras_lms.offload import tensorflow" not in text and "offload import torch" not in text, name


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "elu", "gelu", "hard_swish"])
def test_output_gradient_kernels_and_memory_facts_agree(activation):
    """The active back end takes an activation layer's gradient from its output exactly when its memory facts
    (`memory_facts().output_gradient_activations`, which the planner reads) say its framework does: torch's
    elu gradient reads the input, so elu is recomputed there and the planner must not count it as output-read."""
    unit = keras.layers.Activation(activation)
    backend = offload.active_backend()
    facts = backend.memory_facts()
    uses_output = backend.input_gradient_from_output(unit) is not None
    assert uses_output == (facts.output_gradient_activation(unit) is not None)
    assert facts.backward_reads(unit) == ((False, True) if uses_output else (True, False))
    elu_from_output = keras.backend.backend() == "tensorflow"  # torch's elu_backward is given the input
    assert (backend.input_gradient_from_output(keras.layers.Activation("elu")) is not None) == elu_from_output
