"""How a JAX training step holds device memory: the planner's ``BackendFacts`` for this back end.

What the compiled program does (deviceless H100 compiles, ``docs/jax_findings.md``):

* an offloaded call is not recomputed: its backward reads the forward's own residuals, brought back from host;
* XLA frees every buffer after its last use and fuses element-wise chains, so the plain model keeps no layer
  output past its last reader.
"""

from __future__ import annotations

from keras_lms.planning import BackendFacts


class JaxFacts(BackendFacts):
    """The JAX back end's memory facts (see the module docstring)."""

    recomputes_offloaded_calls = False
    plain_model_keeps_layer_outputs = False


FACTS = JaxFacts()


def memory_facts() -> JaxFacts:
    """The JAX back end's ``BackendFacts`` (the back-end contract's ``memory_facts``)."""
    return FACTS
