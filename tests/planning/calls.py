"""Hand-built traced calls for the pure planning tests: no model is run or traced."""

from __future__ import annotations

from keras_lms.planning import RawCall


def raw_call(unit, inputs, outputs, dtype="float32", offloadable=None):
    """A RawCall of `unit` reading `inputs` and producing `outputs`, each a list of (key, shape without batch)."""
    return RawCall(unit=unit, enclosing=["model"], shapes=[[None, *s] for _, s in inputs],
                   dtypes=[dtype] * len(inputs), ranks=[len(s) + 1 for _, s in inputs], keys=[k for k, _ in inputs],
                   output_shapes=[[None, *s] for _, s in outputs], output_dtypes=[dtype] * len(outputs),
                   offloadable=offloadable, output_keys=[k for k, _ in outputs])


def floats(n: int) -> tuple:
    """The shape (without batch) of a tensor of `n` float32 values."""
    return (n,)
