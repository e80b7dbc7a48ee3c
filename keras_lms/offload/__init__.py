"""How a tensor goes to host and comes back: one module per Keras back end, chosen here.

`active_backend()` returns the offload package of the Keras back end in use (`keras_lms.offload.tensorflow`,
`keras_lms.offload.torch` or `keras_lms.offload.jax`, symmetric as `keras/src/backend/<name>/` are), the way
`keras/src/backend/__init__.py` picks Keras' own back end; the rest of keras-lms (`model`, `report`, `memory`)
reaches the back end only through it, and planning (`keras_lms.planning`) gets it passed in: it imports no back end.
What every back-end module provides is written down once, as the `typing.Protocol` `Backend` (and `StepContextLike`
for the object a training forward pass runs under); `contract_problems(module)` checks a module against it
(`tests/offload/test_backend_contract.py`). The back ends import TensorFlow, torch or JAX, so they are imported only
when asked for: importing `keras_lms` under another Keras back end works (wrapping a model then raises).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Callable, Hashable, Protocol, runtime_checkable

import keras

from keras_lms.offload.common import DeviceStatsUnavailable
from keras_lms.planning import BackendFacts

__all__ = ["Backend", "DeviceStatsUnavailable", "StepContextLike", "active_backend", "contract_problems"]


def active_backend() -> Backend:
    """The offload module of the active Keras back end (`keras.backend.backend()`).

    Returns:
        `keras_lms.offload.tensorflow`, `keras_lms.offload.torch` or `keras_lms.offload.jax`, a module that
        satisfies `Backend`.

    Raises:
        NotImplementedError: Keras runs on a back end keras-lms does not support (e.g. numpy, openvino).
    """
    name = keras.backend.backend()
    if name == "tensorflow":
        from keras_lms.offload import tensorflow as backend_module

        return backend_module
    if name == "torch":
        from keras_lms.offload import torch as backend_module

        return backend_module
    if name == "jax":
        from keras_lms.offload import jax as backend_module

        return backend_module
    raise NotImplementedError(
        f"keras-lms supports the TensorFlow, torch and JAX backends; KERAS_BACKEND is {name!r}. "
        "Set KERAS_BACKEND=tensorflow, torch or jax before importing keras."
    )


@runtime_checkable
class StepContextLike(Protocol):
    """The state of one training forward pass of a wrapped model (what `Backend.StepContext` makes).

    `LMSModel` shadows every offload unit's `call` with `make_wrapper(unit, original)` and runs the forward
    pass inside `forward_scope()`; the object lives as long as that step's backward pass needs it.
    """

    def make_wrapper(self, unit, original) -> Callable:
        """The stand-in for `unit`'s `call` (`original`) during the step: decides, offloads and records."""
        ...

    def forward_scope(self) -> contextlib.AbstractContextManager:
        """A context manager around the forward pass (torch: release graph intermediates early)."""
        ...


class Backend(Protocol):
    """What a back end's offload module provides (a module satisfies this Protocol, PEP 544).

    Planning, the report and the callbacks are shared; everything that touches tensors, devices or the
    framework's autodiff is behind these names, and so is how the framework's step holds memory
    (`memory_facts`), so that a third back end adds a package, not branches on a back-end name.
    """

    def validate_host_device(self, host_device: str) -> str:
        """The canonical name of the CPU device `host_device` names; ValueError when there is no such CPU."""
        ...

    def StepContext(self, config, structure, plan, eager: bool) -> StepContextLike:
        """A `StepContextLike` for one training forward pass under `plan` (`eager`: see `executing_eagerly`)."""
        ...

    def executing_eagerly(self) -> bool:
        """Whether the forward pass runs eagerly (no graph: no per-step host-copy cache or prefetch triggers)."""
        ...

    def signature_of(self, inputs, kwargs) -> Hashable:
        """A hashable key of a call's tensor shapes and dtypes: one plan per input signature."""
        ...

    def trace_calls(self, model, structure, inputs, kwargs) -> list:
        """`model(inputs, training=True)` traced symbolically: one `planning.RawCall` per unit call, in order."""
        ...

    def memory_facts(self) -> BackendFacts:
        """How this back end's training step holds device memory: a `keras_lms.planning.BackendFacts`."""
        ...

    def example_inputs(self, model, batch_size: int) -> Any:
        """Placeholder specs of a built model's inputs at `batch_size`, or None when it records no input shape."""
        ...

    def spec_for(self, shape, dtype) -> Any:
        """A placeholder spec for `trace_calls` from a shape (with the batch axis) and a dtype."""
        ...

    def offloadable_reason(self, unit) -> str | None:
        """Why this back end cannot offload the unit's calls, or None when it can (what only a planning trace finds
        out, such as tied weights on torch, is on the plan: `PlanEntry.unoffloadable`)."""
        ...

    def input_gradient_from_output(self, unit) -> Callable | None:
        """`fn(y, dy)` giving the unit's input gradient from its output `y` (activation layers), or None."""
        ...

    def resolve_jit_compile(self, jit_compile) -> bool:
        """The ``jit_compile`` a wrapped model compiles with when asked for ``jit_compile`` (True, False or
        "auto"); ValueError, naming the fix, for one this back end's offload cannot run under."""
        ...

    def default_device(self) -> str:
        """The device whose memory matters: the first accelerator when there is one, else the CPU."""
        ...

    def training_call_scope(self) -> contextlib.AbstractContextManager | None:
        """A scope each call of the wrapped model's train function runs in (TensorFlow: grappler's own swaps kept
        out, ``offload/tensorflow/call_options.py``), or None where the back end needs none."""
        ...

    def reset_device_peak(self, device: str) -> None:
        """Restart the peak of `device`'s allocator; `DeviceStatsUnavailable` when it keeps no statistics."""
        ...

    def device_peak_bytes(self, device: str) -> int | None:
        """Peak bytes allocated on `device` since the last reset; None (or `DeviceStatsUnavailable`) if unknown."""
        ...


def _members(protocol) -> dict:
    """name -> function of the members a Protocol declares (its own body and its Protocol bases')."""
    members = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol, type(Protocol)) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and callable(value):
                members[name] = value
    return members


def _signature_problem(name: str, expected: Callable, actual: Callable, bound: bool) -> str | None:
    """Why `actual` cannot be called the way `expected` (a Protocol method, `self` dropped) is, or None.

    Compatible: every parameter of the Protocol is accepted by name and position, a parameter the Protocol
    gives a default has one, and any further parameter of `actual` has a default (or is `*args`/`**kwargs`).
    Annotations are not compared.
    """
    try:
        got = inspect.signature(actual)
    except (TypeError, ValueError):
        return f"{name}: no inspectable signature"
    want = list(inspect.signature(expected).parameters.values())[1:]  # drop the Protocol's self
    have = list(got.parameters.values())
    if bound and have and have[0].name == "self":
        have = have[1:]
    variadic = {p.kind for p in have if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    fixed = [p for p in have if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for i, param in enumerate(want):
        if i < len(fixed):
            if fixed[i].name != param.name:
                return f"{name}: parameter {i} is {fixed[i].name!r}, the contract says {param.name!r}"
            if param.default is not param.empty and fixed[i].default is param.empty:
                return f"{name}: parameter {param.name!r} needs a default"
        elif inspect.Parameter.VAR_POSITIONAL not in variadic:
            return f"{name}: takes no parameter {param.name!r}"
    extra = [p.name for p in fixed[len(want):] if p.default is p.empty]
    if extra:
        return f"{name}: extra parameter(s) without a default: {extra}"
    return None


def contract_problems(module: types.ModuleType) -> list[str]:
    """What `module` lacks to satisfy `Backend` (and its `StepContext` class to satisfy `StepContextLike`).

    Args:
        module: a back end's offload module, e.g. `active_backend()`.

    Returns:
        One line per missing member or incompatible signature; empty when the module satisfies the contract.

    Example:

    ```python
    from keras_lms import offload

    assert offload.contract_problems(offload.active_backend()) == []
    ```
    """
    problems = []
    for name, expected in _members(Backend).items():
        actual = getattr(module, name, None)
        if actual is None or not callable(actual):
            problems.append(f"{name}: missing")
            continue
        problem = _signature_problem(name, expected, actual, bound=False)
        if problem:
            problems.append(problem)
    context = getattr(module, "StepContext", None)
    if isinstance(context, type):
        for name, expected in _members(StepContextLike).items():
            actual = getattr(context, name, None)
            if actual is None or not callable(actual):
                problems.append(f"StepContext.{name}: missing")
                continue
            problem = _signature_problem(f"StepContext.{name}", expected, actual, bound=True)
            if problem:
                problems.append(problem)
    return problems
