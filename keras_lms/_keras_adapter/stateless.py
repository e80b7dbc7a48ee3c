"""Stateless execution and autocast: run a layer's ``call`` with its variables mapped to given values.

Keras internals relied on (Keras 3.15), and why:

* ``keras.src.backend.common.variables.AutocastScope`` and ``get_autocast_scope``: the mixed-precision autocast
  dtype ``Layer.__call__`` set for the call in progress, re-created around a recompute that runs outside
  ``Layer.__call__`` so it casts variables exactly as the forward pass did, and switched off to read a
  variable's stored value;
* ``keras.src.backend.common.stateless_scope.get_stateless_scope``: the innermost ``StatelessScope`` (public
  class, private accessor), whose values are the current ones when someone calls ``stateless_call`` on the
  wrapped model;
* ``StatelessScope(collect_losses=True)`` collecting only what ``call`` adds with ``add_loss``
  (``Layer.stateless_call(return_losses=True)`` also returns weight-regularisation losses, which Keras adds
  again from ``model.losses``), and ``Variable.value`` asking the innermost stateless scope's
  ``get_current_value`` (what :func:`recording_variable_reads` records), plus the scope's ``original_scope``
  attribute (the scope it was entered in).
"""

from __future__ import annotations

import contextlib

from keras import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.variables import AutocastScope


def current_autocast_dtype():
    """The mixed-precision autocast dtype ``Layer.__call__`` set for the call in progress (None: no cast)."""
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def run_stateless(layer, call_fn, trainable_values, non_trainable_values, args, kwargs, autocast_dtype=None):
    """Run ``call_fn(*args, **kwargs)`` for ``layer`` with its variables mapped to the given values.

    Returns ``(outputs, new_non_trainable_values, call_losses)``; nothing is assigned. This is
    ``Layer.stateless_call`` minus weight-regularisation losses, and it takes the unpatched ``call``.
    Operations that are not layers (``keras.ops`` nodes of a functional graph) have no variables.
    ``autocast_dtype`` re-creates the autocast scope of the original call, so a recompute outside
    ``Layer.__call__`` casts variables exactly as the forward pass did.
    """
    trainable_vars = list(getattr(layer, "trainable_variables", []))
    non_trainable_vars = list(getattr(layer, "non_trainable_variables", []))
    mapping = list(zip(trainable_vars, trainable_values)) + list(zip(non_trainable_vars, non_trainable_values))
    with AutocastScope(autocast_dtype), StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        outputs = call_fn(*args, **kwargs)
    new_values = [scope.get_current_value(v) for v in non_trainable_vars]
    return outputs, new_values, list(scope.losses)


class _ReadRecordingScope(StatelessScope):
    """A StatelessScope that notes every variable whose value is read and otherwise defers to the scope it is
    entered in (its values, updates and losses), so the code it wraps runs exactly as without it.

    Keras 3.15's ``Variable.value`` asks the innermost stateless scope for ``get_current_value(variable)``; that
    lookup is what is recorded (canary: tests/test_keras_adapter.py).
    """

    def __init__(self):
        super().__init__(initialize_variables=False)
        self.read = {}  # id -> variable, in first-read order

    def __enter__(self):
        super().__enter__()
        self.collect_losses = bool(self.original_scope is not None and self.original_scope.collect_losses)
        return self

    def get_current_value(self, variable):
        self.read.setdefault(id(variable), variable)
        outer = self.original_scope
        return outer.get_current_value(variable) if outer is not None else None

    def add_update(self, update):
        if self.original_scope is not None:
            self.original_scope.add_update(update)
        else:
            super().add_update(update)

    def add_loss(self, loss):
        if self.original_scope is not None:
            self.original_scope.add_loss(loss)
        else:
            super().add_loss(loss)


@contextlib.contextmanager
def recording_variable_reads():
    """Within the block, note every Keras variable whose value is read; yields the list (filled on exit).

    The planning trace uses it to find layers that read trainable variables they do not own (tied weights),
    whose gradients the torch recompute cannot return. Values, updates and losses behave as without it.
    """
    read = []
    with _ReadRecordingScope() as scope:
        yield read
    read.extend(scope.read.values())


def raw_values(variables):
    """Current values of ``variables`` in their storage dtype (no mixed-precision autocast).

    Inside an outer StatelessScope (e.g. someone calls ``stateless_call`` on the wrapped model) the
    scope's values are the current ones.
    """
    scope = get_stateless_scope()
    values = []
    with AutocastScope(None):
        for v in variables:
            value = scope.get_current_value(v) if scope is not None else None
            values.append(v.value if value is None else value)
    return values
