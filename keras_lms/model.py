"""LMSModel: the Keras face of a wrapped model (call, compile, save/load, get_config).

`LMSModel` owns the original model as `inner_model` (weights shared, nothing copied). In training mode
each forward pass intercepts the inner model's layer calls and offloads their inputs to host memory
(`keras_lms.offload`); inference (`predict`, `evaluate`, `training=False`) calls the inner model
directly, so it costs nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import tempfile
import types

import keras

from keras_lms import _keras_adapter as adapter
from keras_lms import graph, memory, planner, policy
from keras_lms.config import LMSConfig

# Training/evaluation hooks a model may override; an overridden one is run on the inner model (see train_step).
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")

XLA_MESSAGE = (
    "keras-lms cannot run under XLA: jit_compile=True ignores the explicit host placement that offloading "
    "relies on, so activations would silently stay on the device. Compile the wrapped model with "
    "jit_compile=False (jit_compile='auto' is resolved to False for wrapped models)."
)


def _backend():
    """The offload module of the active Keras back end.

    Each provides: `validate_host_device`, `StepContext(config, structure, plan, eager)` with
    `make_wrapper(unit, original)`, `executing_eagerly`, `signature_of`, `trace_calls` and
    `example_inputs`.
    """
    name = keras.backend.backend()
    if name == "tensorflow":
        from keras_lms.offload import tensorflow as backend_module

        return backend_module
    if name == "torch":
        from keras_lms.offload import torch as backend_module

        return backend_module
    raise NotImplementedError(
        f"keras-lms supports the TensorFlow and torch backends; KERAS_BACKEND is {name!r}. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch before importing keras."
    )


@keras.saving.register_keras_serializable(package="keras_lms")
class LMSModel(keras.Model):
    """A `keras.Model` that trains `inner_model` with its large activations kept in host memory.

    Create it with `keras_lms.wrap(model, ...)` (or `LMSModel(model, config)`). `compile`, `fit`, `evaluate`,
    `predict` and `save` work as for any Keras model; a model whose class overrides `train_step` /
    `compute_loss` / `test_step` is trained by its own methods. Only training forward passes are offloaded:
    inference calls `inner_model` directly.

    A saved file loads back as an `LMSModel` when `keras_lms` is imported (the class is registered as
    `keras_lms>LMSModel`); `keras_lms.unwrap(wrapped).save(...)` saves the plain model. Weights files
    (`save_weights`) use the plain model's layout, so they load into either.

    Args:
        model: the built `keras.Model` to train (kept as `inner_model`; weights are shared).
        config: the settings, a `keras_lms.LMSConfig`; `None` uses `LMSConfig()`'s defaults.
        **kwargs: passed to `keras.Model` (e.g. `name`, default `"<model name>_lms"`).

    Attributes:
        inner_model: the wrapped `keras.Model`.
        lms_config: the `LMSConfig` in effect.
        lms_plan: one `keras_lms.PlanEntry` per layer call of the last traced training step (the plan at
            batch size 1 before the first step).
        offloaded_bytes_per_step: host bytes of the last traced training step.

    Raises:
        ValueError: `include`/`exclude` name a layer the model does not have, `host_device` is not an
            existing CPU device, or (in `compile`) `jit_compile=True`.
        keras_lms.BudgetError: `config.device_budget` cannot be met even for one sample.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms

    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(256, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    wrapped = keras_lms.LMSModel(model, keras_lms.LMSConfig(min_bytes=0, keep_last=0))
    wrapped.compile(optimizer="sgd", loss="mse")
    wrapped.fit(np.ones((16, 64)), np.ones((16, 1)), batch_size=8, verbose=0)
    print([(entry.layer, entry.offloaded) for entry in wrapped.lms_plan])
    print(wrapped.offloaded_bytes_per_step)       # bytes held in host memory per step
    ```
    """

    def __init__(self, model: keras.Model, config: LMSConfig | None = None, **kwargs):
        kwargs.setdefault("name", f"{model.name}_lms")
        super().__init__(**kwargs)
        self._offload = _backend()
        self.inner_model = model
        self.lms_config = config if config is not None else LMSConfig()
        self._structure = graph.model_structure(model)
        policy.check_selector_names(self.lms_config, self._structure.names)
        self._offload.validate_host_device(self.lms_config.host_device)
        self._plans = {}
        self._last_plan = None
        self._batch_hint = None
        self._offload_depth = 0  # > 0 while a training forward pass of the inner model is being offloaded
        self._custom_steps = custom_step_methods(model)
        self.built = True
        if self.lms_config.device_budget is not None and self._offload.example_inputs(model, 1) is not None:
            self.plan(batch_size=1)  # a budget that not even one sample fits is refused here, not mid-fit

    # ------------------------------------------------------------------ calling
    def call(self, inputs, training=None, **kwargs):
        if not training:
            return self.inner_model(inputs, training=training, **kwargs)
        return self._offloaded(lambda: self.inner_model(inputs, training=training, **kwargs), inputs, kwargs)

    def _offloaded(self, forward, inputs, kwargs):
        """Run `forward()` (a training forward pass of the inner model) with its layer calls offloaded."""
        plan = self._plan_for(inputs, kwargs)
        ctx = self._offload.StepContext(self.lms_config, self._structure, plan, eager=self._offload.executing_eagerly())
        # A back end may need a scope around the forward pass (torch: release graph intermediates early).
        forward_scope = getattr(ctx, "forward_scope", contextlib.nullcontext)
        self._offload_depth += 1
        try:
            with adapter.patched_calls(self._structure.units, ctx.make_wrapper), forward_scope():
                outputs = forward()
        finally:
            self._offload_depth -= 1
        self._last_plan = plan
        return outputs

    # ------------------------------------------------------- custom train steps
    # Note: [custom train steps]. A model that overrides `train_step`/`compute_loss`/`test_step`/...
    # must train exactly as it does unwrapped, so the wrapper runs the *inner model's own* methods (not
    # Keras' defaults, which would silently ignore the override). The inner model is compiled alongside the
    # wrapper with the same optimizer object, loss and metrics, so `self.optimizer`, `self.compute_loss`
    # and `self.metrics` inside the user's step mean what they mean unwrapped; and while the step runs, the
    # inner model's `call` is shadowed so that every training forward pass (`self(x, training=True)`) is
    # offloaded like `LMSModel.call`.
    @property
    def delegates_steps(self) -> bool:
        """True when the inner model overrides a train/test step hook, which the wrapper then runs."""
        return bool(self._custom_steps)

    @contextlib.contextmanager
    def _offloading_inner_calls(self):
        inner = self.inner_model
        original = inner.call

        def offloading_call(*args, **kwargs):
            # Keras passes training= only to a call that accepts it; inside train_step a call is training.
            training = kwargs.get("training", True)
            if not training or self._offload_depth > 0 or not args:  # inference, or the planning trace
                return original(*args, **kwargs)
            rest = {k: v for k, v in kwargs.items() if k != "training"}
            key_kwargs = dict(rest, _extra_args=args[1:]) if len(args) > 1 else rest
            return self._offloaded(lambda: original(*args, **kwargs), args[0], key_kwargs)

        with adapter.patched_attribute(inner, "call", offloading_call):
            yield

    def train_step(self, data):
        if not self._custom_steps:
            return super().train_step(data)
        with self._offloading_inner_calls():
            return self.inner_model.train_step(data)

    def test_step(self, data):
        if not self._custom_steps:
            return super().test_step(data)
        return self.inner_model.test_step(data)

    def predict_step(self, data):
        if not self._custom_steps:
            return super().predict_step(data)
        return self.inner_model.predict_step(data)

    @property
    def metrics(self):
        if getattr(self, "_custom_steps", None):
            return self.inner_model.metrics  # the ones the inner model's own steps update and report
        return super().metrics

    def _plan_for(self, inputs, kwargs):
        key = self._offload.signature_of(inputs, kwargs)
        plan = self._plans.get(key)
        if plan is None:
            batch = _leading_dim(inputs)
            if batch is not None and self._batch_hint is None:
                self._batch_hint = batch
            kwargs = {k: v for k, v in kwargs.items() if k != "_extra_args"}
            self._offload_depth += 1  # the trace calls the inner model: no offloading inside it
            try:
                calls = self._offload.trace_calls(self.inner_model, self._structure, inputs, kwargs)
            finally:
                self._offload_depth -= 1
            plan = planner.build_plan(calls, self.lms_config, batch_size=self._batch_hint or 1,
                                     static_bytes=self.static_bytes())
            memory.check_host_memory(policy.host_bytes_per_step(plan))
            self._plans[key] = plan
        return plan

    def static_bytes(self) -> int:
        """Device bytes of weights, gradients and optimizer state (the planner's non-activation memory)."""
        return planner.static_bytes(self.inner_model, getattr(self, "optimizer", None))

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.fit`; first notes the batch size that will arrive, which the offload plan needs.

        Keras traces the step with an unknown batch axis for `tf.data` without `drop_remainder`, Python
        generators and PyDataset inputs; a plan sized for one sample would offload too little, report too
        little and skip the host-memory guard. The first batch is read ahead (a generator is given back with
        that batch re-inserted; `tf.data` batches are at most as large as the first). When a generator later
        yields a larger batch, the step is re-planned (and re-checked against host memory) before the next step.
        """
        x, hint = _peek_batch_size(x, batch_size, self)
        if hint is not None:
            self.batch_size_hint = hint
        if isinstance(x, types.GeneratorType):
            bound = inspect.signature(keras.Model.fit).bind(self, x, y, batch_size, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self")
            extra = arguments.pop("kwargs", {})
            callbacks = arguments.get("callbacks") or []
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.append(_Replan(self))
            else:
                arguments["callbacks"] = [*callbacks, _Replan(self)]
            return super().fit(**arguments, **extra)
        return super().fit(x, y, batch_size, *args, **kwargs)

    @property
    def batch_size_hint(self):
        """Batch size used for tensors whose batch axis is unknown when a step is traced (set by `fit`)."""
        return self._batch_hint

    @batch_size_hint.setter
    def batch_size_hint(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_size_hint must be a positive integer; got {value!r}.")
        if value != self._batch_hint:
            self._batch_hint = value
            self._plans.clear()  # plans of unknown-batch signatures were sized with the old hint

    def plan(self, batch_size: int = 1) -> list:
        """The offload plan for one training step at `batch_size` (one PlanEntry per layer call)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
        specs = self._offload.example_inputs(self.inner_model, batch_size)
        if specs is None:
            raise ValueError(
                f"Cannot plan for model {self.inner_model.name!r}: it does not record its input shape. "
                "Build it with model.build(input_shape) or train one step; lms_plan then shows the traced plan."
            )
        calls = self._offload.trace_calls(self.inner_model, self._structure, specs, {})
        return planner.build_plan(calls, self.lms_config, batch_size=batch_size, static_bytes=self.static_bytes())

    @property
    def lms_plan(self) -> list:
        """One PlanEntry per layer call of the last traced training step.

        Before the first training step it is the plan at batch size 1 (bytes are then per sample).
        """
        if self._last_plan is None:
            self._last_plan = self.plan(batch_size=1)
        return self._last_plan

    @property
    def offloaded_bytes_per_step(self) -> int:
        """Host bytes of the last traced training step (each offloaded tensor counted once)."""
        return policy.host_bytes_per_step(self._last_plan or [])

    # ---------------------------------------------------------------- compiling
    def compile(self, *args, jit_compile="auto", **kwargs):
        if jit_compile is True:
            raise ValueError(XLA_MESSAGE)
        if jit_compile not in ("auto", False):
            raise ValueError(f"jit_compile must be False or 'auto' for a wrapped model; got {jit_compile!r}.")
        super().compile(*args, jit_compile=False, **kwargs)
        if self._custom_steps:
            # The inner model's own steps read its compile state: give it the same optimizer object (one set of
            # slots, shared by both), loss and metrics. See Note: [custom train steps].
            bound = inspect.signature(keras.Model.compile).bind(self, *args, **kwargs)
            bound.arguments.pop("self")
            bound.arguments["optimizer"] = self.optimizer
            self.inner_model.compile(**bound.arguments, jit_compile=False)

    def compile_from_config(self, config):
        """Re-compile on load (Keras skips this for models that override `compile`)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def jit_compile(self):
        return False

    @jit_compile.setter
    def jit_compile(self, value):
        if value is True:
            raise ValueError(XLA_MESSAGE)
        self._jit_compile = False

    # ------------------------------------------------------------------- saving
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`, checked before any file is opened and written atomically.

        Settings that cannot be saved (a predicate in include/exclude) and the legacy `.h5` format (which
        cannot store a wrapped model) are refused before anything is written. A local `.keras` file is
        written to a temporary file next to it and moved into place with `os.replace`, so an interrupted
        save (a crash, a kill, a full disk) leaves the previous file intact.
        """
        path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
        if path is not None and path.endswith((".h5", ".hdf5")):
            raise ValueError(
                f"Cannot save the wrapped model {self.name!r} in the legacy HDF5 format ({path!r}): it cannot store "
                "a keras-lms wrapper. Save it as '.keras' (wrapped.save('model.keras')), or save the plain model "
                "to .h5 with keras_lms.unwrap(wrapped).save(...), or only the weights with save_weights(...)."
            )
        self.get_config()  # raises the clear error for unsavable settings before a file is touched
        local = path is not None and path.endswith(".keras") and "://" not in path and zipped is not False
        if not local or (not overwrite and os.path.exists(path)):
            return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp.keras", dir=directory)
        os.close(fd)
        try:
            super().save(tmp, overwrite=True, zipped=zipped, **kwargs)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # Note: [interchangeable weights files]. Weights files of a wrapped model use the layout of the plain
    # model (its layers at the top, the optimizer next to them), so a `save_weights` file or a
    # `ModelCheckpoint(save_weights_only=True)` of either loads into the other. Files written by keras-lms
    # 0.1 (everything under `inner_model/`) still load into a wrapped model.
    @contextlib.contextmanager
    def _inner_with_our_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            optimizer = getattr(self.inner_model, "optimizer", None)
        with adapter.patched_attribute(self.inner_model, "optimizer", optimizer):
            yield self.inner_model

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save_weights` in the layout of the plain model (interchangeable with it)."""
        with self._inner_with_our_optimizer() as inner:
            return inner.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Load weights saved by this wrapper, by another wrapper of the same model, or by the plain model."""
        if _saved_by_wrapper_0_1(filepath):
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        with self._inner_with_our_optimizer() as inner:
            return inner.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def get_config(self):
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.inner_model),
            "lms_config": self.lms_config.to_dict(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        inner = keras.saving.deserialize_keras_object(config["model"], custom_objects=custom_objects)
        return cls(inner, LMSConfig.from_dict(config["lms_config"]), name=config.get("name"))


def _saved_by_wrapper_0_1(filepath) -> bool:
    """A `.weights.h5` file in the 0.1 layout of wrapped models (everything under `inner_model/`)."""
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else ""
    if not path.endswith(".weights.h5") or not os.path.exists(path):
        return False
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return "inner_model" in f and "layers" not in f
    except OSError:
        return False


def custom_step_methods(model) -> list:
    """The names in STEP_METHODS that `model`'s class overrides (Keras' own models override none)."""
    return [name for name in STEP_METHODS if getattr(type(model), name, None) is not getattr(keras.Model, name)]


def _batch_size_of(x, batch_size):
    """The batch size `fit` will use, when it can be known without consuming the data."""
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return batch_size
    if isinstance(x, keras.utils.PyDataset):
        try:
            first = x[0]
        except Exception:  # a dataset that cannot be indexed up front: no hint
            return None
        return _leading_dim(first[0] if isinstance(first, tuple) else first)
    element_spec = getattr(x, "element_spec", None)  # tf.data.Dataset
    if element_spec is not None:
        spec = element_spec[0] if isinstance(element_spec, tuple) else element_spec
        return _leading_dim(spec)
    n = _leading_dim(x)
    return None if n is None else min(32, n)  # Keras' default batch size for arrays


def _monitored(first, rest, model):
    """Re-yields a generator's batches (the peeked first one first) and notes a batch larger than the plan's."""
    largest = _leading_dim(first[0] if isinstance(first, tuple) else first) or 0
    yield first
    for batch in rest:
        n = _leading_dim(batch[0] if isinstance(batch, tuple) else batch)
        if n is not None and n > largest:
            largest = n
            if model._batch_hint is not None and n > model._batch_hint:
                model._pending_batch_hint = n
        yield batch


class _Replan(keras.callbacks.Callback):
    """Re-plans the step (new trace) when a generator yielded a batch larger than the plan's."""

    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped

    def on_train_batch_begin(self, batch, logs=None):
        pending = getattr(self.wrapped, "_pending_batch_hint", None)
        if pending is not None and pending > (self.wrapped._batch_hint or 0):
            self.wrapped._pending_batch_hint = None
            self.wrapped.batch_size_hint = pending  # clears the plans: the next trace plans for this batch
            self.wrapped.make_train_function(force=True)


def _peek_batch_size(x, batch_size, model):
    """`(x, batch)`: the data to hand to Keras (a peeked generator re-assembled) and its batch size or None."""
    hint = _batch_size_of(x, batch_size)
    if hint is not None:
        return x, hint
    if isinstance(x, types.GeneratorType):
        try:
            first = next(x)
        except StopIteration:
            return x, None
        return _monitored(first, x, model), _leading_dim(first[0] if isinstance(first, tuple) else first)
    if hasattr(x, "element_spec") and hasattr(x, "take"):  # tf.data with an unknown batch axis
        try:
            first = next(iter(x.take(1)))
        except (StopIteration, TypeError, ValueError):
            return x, None
        return x, _leading_dim(first[0] if isinstance(first, tuple) else first)
    return x, None


def _leading_dim(inputs):
    for leaf in keras.tree.flatten(inputs):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


# wrap()'s keyword defaults are LMSConfig's field defaults: the settings have one set of defaults, in config.py.
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(LMSConfig)}


def wrap(model, *, min_bytes=_DEFAULTS["min_bytes"], keep_last=_DEFAULTS["keep_last"], include=_DEFAULTS["include"],
         exclude=_DEFAULTS["exclude"], host_device=_DEFAULTS["host_device"], prefetch=_DEFAULTS["prefetch"],
         device_budget=_DEFAULTS["device_budget"], config=None) -> LMSModel:
    """Wrap `model` so that training keeps its large activations in host memory.

    During a training step every offloaded layer call copies its inputs to `host_device` in the forward pass;
    its backward pass copies them back and recomputes the call, so the device holds the activations only
    around their own use. The wrapped model computes exactly what `model` computes (the same loss, gradients,
    BatchNorm statistics and Dropout masks); inference (`predict`, `evaluate`, `training=False`) calls `model`
    directly. `wrapped.lms_plan` says for every layer call what is offloaded and why.

    Args:
        model: a built `keras.Model`: Sequential, Functional, nested or subclassed. Its weights are shared
            with the wrapper, not copied.
        min_bytes: layer inputs smaller than this (bytes per training step, or a size string like `"1MiB"`)
            stay on the device; `0` offloads every eligible tensor. Defaults to `1 << 20` (1 MiB).
        keep_last: the last `keep_last` layer calls of the forward pass keep their inputs on the device (their
            backward runs first). `0` keeps none. Defaults to `1`.
        include: only these layers may be offloaded: layer names (or a nested model's name), layer classes,
            or predicates `layer -> bool`. `None` (the default) considers every layer.
        exclude: these layers are never offloaded (same forms as `include`; wins over it). Defaults to `None`.
        host_device: the CPU device that holds offloaded tensors. Defaults to `"/CPU:0"`.
        prefetch: the copy back starts `prefetch` layer calls ahead in the backward pass (`0`: when the
            layer's gradient arrives). Defaults to `1`.
        device_budget: `None`, or bytes / a size string such as `"6GiB"`: offload only what the predicted
            training step needs to fit the budget (largest, longest-lived tensors first; nothing when it fits
            anyway). Defaults to `None`.
        config: a `keras_lms.LMSConfig` to use instead of the keyword settings above (pass one or the other).

    Returns:
        A `keras_lms.LMSModel` (a `keras.Model`): `compile`, `fit`, `evaluate`, `predict` and `save` work as
        usual (`jit_compile=True` is refused: XLA ignores host placement).

    Raises:
        TypeError: `model` is not a `keras.Model`, `config` is not an `LMSConfig`, or a setting has the wrong
            type (see `LMSConfig`).
        ValueError: `model` is not built, is already wrapped or contains a wrapped model; `config` is given
            together with keyword settings; a setting has an impossible value or names a layer the model does
            not have; `host_device` is not an existing CPU device.
        keras_lms.BudgetError: `device_budget` cannot be met even with every eligible tensor offloaded (the
            message names the largest layer call).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms

    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
    wrapped = keras_lms.wrap(model, min_bytes="16KiB")
    wrapped.compile(optimizer="adam", loss="mse")
    wrapped.fit(np.zeros((8, 32, 32, 3)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
    for entry in wrapped.lms_plan:
        print(entry)
    assert keras_lms.unwrap(wrapped) is model
    ```
    """
    if isinstance(model, LMSModel):
        raise ValueError(
            f"Model {model.name!r} is already wrapped by keras-lms. Use it as is, or wrap "
            "keras_lms.unwrap(model) to change the settings."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"keras_lms.wrap expects a keras.Model; got {type(model).__name__}. "
            "Put a single layer into a model first, e.g. keras.Sequential([keras.Input(shape), layer])."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its layers have no weights to offload around. Build it first: "
            "give it an Input (keras.Input(shape=...)), call model.build(input_shape), or call it on one batch."
        )
    nested_wrapped = [m.name for m in graph.model_structure(model).models[1:] if isinstance(m, LMSModel)]
    if nested_wrapped:
        raise ValueError(
            f"Model {model.name!r} contains wrapped model(s) {nested_wrapped}. Wrap only the outermost model: "
            "replace the inner ones by keras_lms.unwrap(inner)."
        )
    given = dict(min_bytes=min_bytes, keep_last=keep_last, include=include, exclude=exclude,
                 host_device=host_device, prefetch=prefetch, device_budget=device_budget)
    if config is not None:
        if not isinstance(config, LMSConfig):
            raise TypeError(f"config must be a keras_lms.LMSConfig; got {type(config).__name__}.")
        changed = sorted(k for k, v in given.items() if v != _DEFAULTS[k])
        if changed:
            raise ValueError(f"Pass either config= or keyword settings, not both (got config and {changed}).")
    else:
        config = LMSConfig(**given)
    return LMSModel(model, config)


def unwrap(wrapped) -> keras.Model:
    """The original model of a wrapped one.

    Args:
        wrapped: a model returned by `keras_lms.wrap` (or loaded from a file it saved).

    Returns:
        The `keras.Model` that was wrapped: the same object, so its weights are the trained ones.

    Raises:
        TypeError: `wrapped` is not a `keras_lms.LMSModel`.

    Example:

    ```python
    import keras
    import keras_lms

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert keras_lms.unwrap(keras_lms.wrap(model)) is model
    ```
    """
    if not isinstance(wrapped, LMSModel):
        raise TypeError(f"keras_lms.unwrap expects a model returned by keras_lms.wrap; got {type(wrapped).__name__}.")
    return wrapped.inner_model
