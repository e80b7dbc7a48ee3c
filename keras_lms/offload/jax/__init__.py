"""Activation offload on the JAX back end (not yet a registered back end; docs/jax_findings.md).

`host_residuals`: a layer's call with its backward residuals in host memory, ordered by optimisation barriers.
`lean`: lean backward rules XLA needs. `deviceless`: compile a step for an H100 without one and read its memory.
"""
