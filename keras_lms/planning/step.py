"""One planning entry point: trace a training step, count what it holds besides activations, decide the plan.

``plan_step`` is the sequence trace -> static bytes -> optimizer-update temporaries -> rules and budget, written
once for the wrapped model's per-signature plans, ``LMSModel.plan(batch_size)`` and ``keras_lms.report``. The
back end is passed in (an object satisfying ``keras_lms.offload.Backend``): planning imports no back end.
"""

from __future__ import annotations

import dataclasses

from keras_lms.config import LMSConfig
from keras_lms.planning.backend_facts import BackendFacts
from keras_lms.planning.budget import build_plan
from keras_lms.planning.memory_model import StepMemory, simulate, static_bytes


@dataclasses.dataclass
class StepPlan:
    """One training step, planned: its traced calls, the decision on each, and what memory predictions need.

    Attributes:
        calls: one ``RawCall`` per layer call of the traced forward pass, in order.
        entries: one ``PlanEntry`` per call (what ``LMSModel.lms_plan`` lists).
        config: the ``LMSConfig`` the plan was made with.
        facts: the back end's ``BackendFacts``.
        batch_size: samples per step (for tensors whose batch axis is unknown).
        static_bytes: weights, gradients, optimizer state and what the back end holds the whole step.
        update_bytes: the optimizer update's temporaries.
    """

    calls: list
    entries: list
    config: LMSConfig
    facts: BackendFacts
    batch_size: int
    static_bytes: int
    update_bytes: int

    def plain_memory(self) -> StepMemory:
        """The predicted device memory of the step without keras-lms."""
        none = [[False] * len(entry.tensor_offloaded) for entry in self.entries]
        return simulate(self.calls, none, self.facts, self.batch_size, self.config.prefetch, self.static_bytes,
                        unwrapped=True, update_bytes=self.update_bytes)

    def wrapped_memory(self) -> StepMemory:
        """The predicted device memory of the step as planned (with the slab size the planner chose)."""
        offloaded = [list(entry.tensor_offloaded) for entry in self.entries]
        # the budget planner may have chosen smaller slabs than the config's (budget.fit_budget)
        slab_bytes = min((e.slab_bytes for e in self.entries if e.offloaded), default=self.config.slab_bytes)
        return simulate(self.calls, offloaded, self.facts, self.batch_size, self.config.prefetch,
                        self.static_bytes, update_bytes=self.update_bytes,
                        lean_normalization=self.config.lean_normalization, slab_bytes=slab_bytes)


def plan_step(backend, model, structure, config: LMSConfig, inputs, kwargs=None, batch_size: int = 1,
              optimizer=None) -> StepPlan:
    """Plan one training step of ``model`` on ``inputs`` (tensors or the back end's placeholder specs).

    Args:
        backend: the back end's offload module (``keras_lms.offload.active_backend()``, or any object with
            ``trace_calls`` and ``memory_facts``).
        model: the plain model; ``structure`` its ``planning.structure.ModelStructure``.
        config: the ``LMSConfig`` to plan with.
        inputs / kwargs: what ``model(inputs, training=True, **kwargs)`` is traced with.
        batch_size: the batch size for tensors whose batch axis is unknown when traced.
        optimizer: the optimizer whose state and update the step holds (``None``: Adam-like defaults).

    Returns:
        A ``StepPlan``.

    Raises:
        keras_lms.BudgetError: ``config.device_budget`` cannot be met.
    """
    calls = backend.trace_calls(model, structure, inputs, kwargs or {})
    facts = backend.memory_facts()
    static = static_bytes(model, facts, optimizer)
    update = facts.update_temporary_bytes(model, optimizer)
    entries = build_plan(calls, config, facts, batch_size, static, update)
    return StepPlan(calls, entries, config, facts, batch_size, static, update)
