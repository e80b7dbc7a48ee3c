"""Keras' fit loop, for `keras_lms.BackupAndRestore`: start at a given epoch, and pass over batches already trained.

Keras internals relied on (Keras 3.15), and why:

* `Trainer._initial_epoch`: `fit` starts at `model._initial_epoch or initial_epoch` (the TensorFlow, torch and
  JAX trainers read it after `on_train_begin`); it is how `keras.callbacks.BackupAndRestore` resumes, and the only
  way a callback can move the first epoch of a `fit` that is already running;
* what `fit` passes to `model.train_function` (made before `on_train_begin`, called once per batch, or per
  `steps_per_execution` batches): on TensorFlow the epoch's data iterator, which the function advances itself; on
  torch the batch, already read; on JAX `(state, iterator)`, where `state` is the tuple of trainable,
  non-trainable, optimizer and metrics variable values the loop holds (the variables themselves are purged while
  it runs) and the function returns `(logs, state)`. A resumed epoch must read the batches that were trained
  before the backup without training on them, so that the next batch is the one the interrupted run would have
  trained next;
* `Trainer._symbolic_build(data_batch=...)`: builds the compiled metrics from one batch, as `fit` does on torch
  and JAX; TensorFlow builds them only when it traces the first step, after the skipped batches;
* the global `SeedGenerator` of `keras.random` calls without a seed (the global-state attribute
  `global_seed_generator`, created on first use): its state is part of what an exact resume restores.

A private attribute that is gone raises `RuntimeError` naming the adapter function and the Keras versions.
"""

from __future__ import annotations

import keras

from keras_lms._keras_support import SUPPORTED_KERAS

SKIPPING_BACKENDS = ("tensorflow", "torch", "jax")


def _gone(function: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"keras_lms._keras_adapter.{function}() relies on {what}, private API of Keras "
        f"{SUPPORTED_KERAS[0]},{SUPPORTED_KERAS[1]} that Keras {keras.__version__} does not have. The adapter needs "
        "updating for this Keras (tests/test_keras_adapter.py names each assumption)."
    )


def initial_epoch(model):
    """The epoch the next `fit` of `model` starts at when a callback set one (`Trainer._initial_epoch`), else None."""
    if not hasattr(model, "_initial_epoch"):
        raise _gone("initial_epoch", f"{type(model).__name__}._initial_epoch")
    return model._initial_epoch


def set_initial_epoch(model, epoch) -> None:
    """Make the `fit` now starting (`on_train_begin`) begin at `epoch` (`None`: at fit's own `initial_epoch`)."""
    if not hasattr(model, "_initial_epoch"):
        raise _gone("set_initial_epoch", f"{type(model).__name__}._initial_epoch")
    model._initial_epoch = epoch


def can_skip_train_steps(model) -> bool:
    """Whether `skipping_train_function` can wrap `model`'s train function: `fit` made it (so this is called
    inside `fit`), and the back end is one whose train-function argument it knows."""
    return keras.backend.backend() in SKIPPING_BACKENDS and getattr(model, "train_function", None) is not None


def skipping_train_function(model, steps: int, on_done=None):
    """`model.train_function`, but the first `steps` batches it is given are read and not trained on.

    Install it in `on_train_begin` (`model.train_function = skipping_train_function(model, n)`). The first
    skipped call builds the compiled metrics if they are not built yet (TensorFlow builds them when it traces the
    first training step, which a resumed epoch reaches only after the skipped batches). Right after the last
    skipped batch is read, `on_done()` is called: the moment the interrupted run took its backup. A skipped call
    returns the model's current metric results as its logs; later calls go to the original function
    (`.original`), and `.done()` says when that point is reached.
    """
    if not can_skip_train_steps(model):
        raise NotImplementedError(
            f"Skipping trained batches needs the train function fit() makes, on the {' or '.join(SKIPPING_BACKENDS)} "
            f"back end (here: {keras.backend.backend()!r}, train_function={model.train_function!r})."
        )
    original = model.train_function
    tensorflow = keras.backend.backend() == "tensorflow"
    remaining = [int(steps)]
    first = [True]
    if keras.backend.backend() == "jax":
        return _skipping_jax_train_function(model, original, remaining, on_done)

    def train_function(data):
        if remaining[0] <= 0:
            return original(data)
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        batches = [next(data) for _ in range(min(per_call, remaining[0]))] if tensorflow else list(data)
        remaining[0] -= per_call
        if first[0]:
            first[0] = False
            _build_metrics(model, batches[0])
        if remaining[0] <= 0 and on_done is not None:
            on_done()
        try:
            return model.get_metrics_result()
        except ValueError:  # metrics a custom train_step builds itself: not built until it runs
            return {}

    train_function.original = original
    train_function.done = lambda: remaining[0] <= 0
    return train_function


def _skipping_jax_train_function(model, original, remaining, on_done):
    """`skipping_train_function` for Keras' JAX trainer: ``(state, iterator) -> (logs, state)``.

    A skipped call reads its batches from the iterator and hands the loop's state back unchanged. Its logs are the
    metrics' results computed from that state (the metric variables are purged while the loop runs). After the
    last skipped batch, `on_done()` assigns the interrupted epoch's metric values to the metric variables, and
    the state handed back carries them: the loop keeps training from its own state, not from the variables.
    Relies on `Variable._value` being None for a variable the JAX loop purged.
    """

    def metric_logs(metrics_values):
        logs, start = {}, 0
        for metric in model.metrics:
            count = len(metric.variables)
            result = metric.stateless_result(metrics_values[start:start + count])
            start += count
            if isinstance(result, dict):
                logs.update(result)
            else:
                logs[metric.name] = result
        return logs

    def train_function(state, iterator):
        if remaining[0] <= 0:
            return original(state, iterator)
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        for _ in range(min(per_call, remaining[0])):
            next(iterator)
        remaining[0] -= per_call
        if remaining[0] <= 0 and on_done is not None:
            on_done()
            # what on_done assigned (a purged variable's `_value` is None: the loop's own value stays)
            trainable, non_trainable, optimizer, metrics = state
            state = (trainable, non_trainable, optimizer,
                     [old if getattr(v, "_value", None) is None else v.value
                      for v, old in zip(model.metrics_variables, metrics)])
        return metric_logs(state[3]), state

    train_function.original = original
    train_function.done = lambda: remaining[0] <= 0
    return train_function


def build_compiled_metrics(model, batch) -> None:
    """Build a compiled model's loss and metrics from one ``(x, y)`` batch, as ``fit`` does before its first step:
    what a step compiled outside ``fit`` (the deviceless compile of ``keras_lms.offload.jax.deviceless``, its
    tests and benchmarks) needs first. (Unconditional: before the first build, ``model.metrics`` lists only
    built trackers, so ``_build_metrics``' check would skip it.)"""
    if not hasattr(model, "_symbolic_build"):
        raise _gone("build_compiled_metrics", f"{type(model).__name__}._symbolic_build")
    model._symbolic_build(data_batch=batch)


def _build_metrics(model, batch) -> None:
    """Build the compiled metrics and loss from one batch, as `fit` does before training on torch and JAX.

    Relies on `Trainer._symbolic_build(data_batch=...)` (symbolic: no variable changes but the new ones).
    """
    if all(getattr(metric, "built", True) for metric in model.metrics):
        return
    if not hasattr(model, "_symbolic_build"):
        raise _gone("skipping_train_function", f"{type(model).__name__}._symbolic_build")
    model._symbolic_build(data_batch=batch)


def global_seed_generator(create: bool = False):
    """The `keras.random.SeedGenerator` that `keras.random` calls without a seed draw from; None if none was made.

    `create=True` makes it (as the first unseeded call would) so that a saved state can be assigned to it.
    """
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    name = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", None)
    if name is None:
        raise _gone("global_seed_generator", "keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR")
    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(name)
