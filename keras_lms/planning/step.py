"""One planning entry point: trace a training step, count what it holds besides activations, decide the plan.

``plan_step`` is the sequence trace -> static bytes -> optimizer-update temporaries -> rules and budget -> copies
back started earlier where a backward waits for them (``copy_back_leads``), written once for the wrapped model's
per-signature plans, ``LMSModel.plan(batch_size)`` and ``keras_lms.report``. The back end is passed in
(an object satisfying ``keras_lms.offload.Backend``): planning imports no back end.
"""

from __future__ import annotations

import dataclasses

from keras_lms.config import LMSConfig
from keras_lms.planning import rules
from keras_lms.planning.backend_facts import BackendFacts
from keras_lms.planning.budget import build_plan
from keras_lms.planning.copy_back_leads import plan_copy_back_leads
from keras_lms.planning.memory_model import StepMemory, simulate, static_bytes
from keras_lms.planning.plan import (
    planned_leads,
    planned_prefetch,
    planned_short_chains,
    planned_slab_bytes,
    planned_sweeps,
)
from keras_lms.planning.recompute import recomputed_producers
from keras_lms.planning.step_time import StepTime, predict_step_time
from keras_lms.planning.traffic import LinkTraffic, link_traffic


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

    @property
    def offloaded(self) -> list:
        """Per call, per input tensor: whether the plan sends it to host."""
        return [list(entry.tensor_offloaded) for entry in self.entries]

    @property
    def prefetch(self) -> int:
        """How many calls ahead the step starts copies back (the planner may have chosen deeper than the config)."""
        return planned_prefetch(self.entries, self.config.prefetch)

    @property
    def leads(self):
        """How many calls ahead each call's copies back start: ``prefetch``, or one depth per call where the
        planner started some earlier (``plan.planned_leads``)."""
        return planned_leads(self.entries, self.config.prefetch)

    @property
    def slab_bytes(self) -> int:
        """The slab size the step uses (the budget planner may have chosen smaller slabs than the config's)."""
        return planned_slab_bytes(self.entries, self.config.slab_bytes)

    def wrapped_memory(self, offloaded=None) -> StepMemory:
        """The predicted device memory of the step as planned (or with ``offloaded`` instead of the plan's, with
        nothing recomputed)."""
        return simulate(self.calls, self.offloaded if offloaded is None else offloaded, self.facts, self.batch_size,
                        self.leads if offloaded is None else self.config.prefetch, self.static_bytes,
                        update_bytes=self.update_bytes,
                        lean_normalization=self.config.lean_normalization, slab_bytes=self.slab_bytes,
                        recomputed=self.recomputed if offloaded is None else frozenset(),
                        swept=self.swept if offloaded is None else None,
                        short_chains=self.short_chains if offloaded is None else frozenset())

    def offload_only(self) -> list:
        """The offload-only plan: every tensor the per-call rules (min_bytes, keep_last, include/exclude) allow
        goes to host, with no narrowing to ``device_budget`` (what keras-lms did before budgets)."""
        return [list(d.offload_tensor) for d in rules.decide_all(self.calls, self.config, self.batch_size)]

    @property
    def recomputed(self) -> frozenset:
        """The calls whose outputs the plan recomputes in windows instead of copying (``planning.recompute``)."""
        return recomputed_producers(self.entries)

    @property
    def short_chains(self) -> frozenset:
        """The activations that take their BatchNorm's first pass on its input's windows (short fused chains)."""
        return planned_short_chains(self.entries)

    @property
    def swept(self) -> dict:
        """The level sweeps the plan runs, first call -> windows (TensorFlow: ``offload.tensorflow.sweeps``)."""
        return planned_sweeps(self.entries)

    def link_traffic(self, offloaded=None) -> LinkTraffic:
        """The host-link transfers of the plan (or of ``offloaded``, with nothing recomputed or swept):
        ``traffic.link_traffic``."""
        if offloaded is None:
            return link_traffic(self.calls, self.offloaded, self.facts, self.batch_size, self.slab_bytes,
                                self.recomputed, self.swept, self.short_chains)
        return link_traffic(self.calls, offloaded, self.facts, self.batch_size, self.slab_bytes)

    def recompute_candidates(self) -> frozenset:
        """The calls whose outputs the back end could recompute in windows with the plan's offload decisions
        (``BackendFacts.recompute_sources``): the planner chooses among them."""
        slabs = self.facts.slab_plans(self.calls, self.offloaded, self.batch_size, self.slab_bytes)
        chains = self.facts.fused_slab_chains(self.calls, self.offloaded, slabs, self.short_chains) if slabs else {}
        sources = self.facts.recompute_sources(self.calls, self.offloaded, slabs, chains, self.batch_size)
        return frozenset(s.producer for s in sources.values() if s.chosen)

    def step_time(self, profile, offloaded=None, recomputed=None, swept=None) -> StepTime:
        """The predicted step time on ``profile`` (a ``DeviceProfile``) of the plan, or of ``offloaded`` (all
        False: the plain step); with the plan's recomputed tensors and sweeps, or ``recomputed`` / ``swept``
        (none for ``offloaded``)."""
        if recomputed is None:
            recomputed = self.recomputed if offloaded is None else frozenset()
        if swept is None:
            swept = self.swept if offloaded is None else {}
        return predict_step_time(self.calls, self.offloaded if offloaded is None else offloaded, self.facts,
                                 profile, self.batch_size, self.leads if offloaded is None else self.config.prefetch,
                                 self.slab_bytes, self.config.lean_normalization, recomputed, swept,
                                 self.short_chains if offloaded is None else frozenset())


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
    plan_copy_back_leads(calls, entries, config, facts, batch_size, static, update)
    return StepPlan(calls, entries, config, facts, batch_size, static, update)
