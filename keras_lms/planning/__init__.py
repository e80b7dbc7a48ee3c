"""Planning: what a wrapped model's training step holds on the device, and which tensors go to host.

Pure Python over the layer calls a trace records; it imports no back end (tests/test_architecture.py checks
that). The back end is passed in, and what differs between frameworks is asked of its ``BackendFacts``.

The modules, following the data: ``structure`` (which layer calls a model makes), ``layer_facts`` (what is true
of Keras' layers), ``backend_facts`` (how a back end's step holds memory), ``plan`` (the plan's types),
``rules`` (min_bytes, keep_last, include/exclude), ``memory_model`` (the device-memory timeline), ``budget``
(narrowing to ``device_budget``) and ``step`` (``plan_step``, the one entry point).
"""

from keras_lms.planning.backend_facts import BackendFacts
from keras_lms.planning.budget import BudgetError, build_plan
from keras_lms.planning.memory_model import BUDGET_MARGIN, StepMemory, simulate, static_bytes, variable_bytes
from keras_lms.planning.plan import CallDecision, PlanEntry, RawCall, host_bytes_per_step, tensor_bytes
from keras_lms.planning.step import StepPlan, plan_step
from keras_lms.planning.structure import ModelStructure, model_structure

__all__ = [
    "BUDGET_MARGIN", "BackendFacts", "BudgetError", "CallDecision", "ModelStructure", "PlanEntry", "RawCall",
    "StepMemory", "StepPlan", "build_plan", "host_bytes_per_step", "model_structure", "plan_step", "simulate",
    "static_bytes", "tensor_bytes", "variable_bytes",
]
