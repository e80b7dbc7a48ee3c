"""LMSModel: the Keras face of a wrapped model (call, compile, save/load, get_config).

`LMSModel` owns the original model as `inner_model` (weights shared, nothing copied). In training mode
each forward pass intercepts the inner model's layer calls and offloads their inputs to host memory
(`keras_lms.offload`); inference (`predict`, `evaluate`, `training=False`) calls the inner model
directly, so it costs nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import keras

from keras_lms import _keras_adapter as adapter
from keras_lms import batching, memory, offload, planning, saving
from keras_lms.config import LMSConfig
from keras_lms.offload.common import called_in_scope
from keras_lms.planning import rules

# Training/evaluation hooks a model may override; an overridden one is run on the inner model (see train_step).
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")

XLA_MESSAGE = offload.common.XLA_MESSAGE


def _check_wrappable(model) -> None:
    """The errors for a model that cannot be wrapped, each naming the fix."""
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


@keras.saving.register_keras_serializable(package="keras_lms")
class LMSModel(saving.WrappedModelFiles, keras.Model):
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
        # Checked here, not only in wrap(): `LMSModel(model, config)` is documented, and loading calls it too.
        _check_wrappable(model)
        if config is not None and not isinstance(config, LMSConfig):
            raise TypeError(f"config must be a keras_lms.LMSConfig; got {type(config).__name__}.")
        kwargs.setdefault("name", f"{model.name}_lms")
        super().__init__(**kwargs)
        self._offload = offload.active_backend()
        self.inner_model = model
        self.lms_config = config if config is not None else LMSConfig()
        self._structure = planning.model_structure(model)  # the one walk of the model
        nested_wrapped = [m.name for m in self._structure.models[1:] if isinstance(m, LMSModel)]
        if nested_wrapped:
            raise ValueError(
                f"Model {model.name!r} contains wrapped model(s) {nested_wrapped}. Wrap only the outermost model: "
                "replace the inner ones by keras_lms.unwrap(inner)."
            )
        rules.check_selector_names(self.lms_config, self._structure.names)
        self._offload.validate_host_device(self.lms_config.host_device)
        self._plans = {}
        self._example_plans = {}  # plan(batch_size): (batch size, static bytes, optimizer) -> entries
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
        self._offload_depth += 1
        try:
            # The back end's scope around the forward pass (torch: release graph intermediates early).
            with adapter.patched_calls(self._structure.units, ctx.make_wrapper), ctx.forward_scope():
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
    def lms_structure(self) -> planning.ModelStructure:
        """The offload units of `inner_model` (read-only, found when the wrapper is made; `keras_lms.report` uses it).

        Returns:
            A `keras_lms.planning.ModelStructure`: `units` (the intercepted layers and `keras.ops` nodes, in discovery
            order), `models` (`inner_model` and every model nested in it), `unit_models` (`id(unit)` -> the names
            of its enclosing models, outermost first) and `names` (what `include`/`exclude` may name).

        Raises:
            AttributeError: on assignment.

        Example:

        ```python
        import keras
        import keras_lms

        block = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="inner_dense")], name="block")
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(block(inputs)), name="model")
        structure = keras_lms.wrap(model).lms_structure
        print([unit.name for unit in structure.units], sorted(structure.names))  # units: inner_dense, head
        ```
        """
        return self._structure

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

    def make_train_function(self, force=False):
        """Keras' train function, each call inside the back end's training-call scope where it has one
        (TensorFlow: grappler's own swaps kept out of the wrapped step, ``offload/tensorflow/call_options.py``)."""
        super().make_train_function(force)
        self.train_function = called_in_scope(self.train_function, self._offload.training_call_scope)
        return self.train_function

    # `*args`: TensorFlow's and torch's steps take `(data)`, JAX's stateless ones `(state, data)`.
    def train_step(self, *args):
        if not self._custom_steps:
            return super().train_step(*args)
        with self._offloading_inner_calls():
            return self.inner_model.train_step(*args)

    def test_step(self, *args):
        if not self._custom_steps:
            return super().test_step(*args)
        return self.inner_model.test_step(*args)

    def predict_step(self, *args):
        if not self._custom_steps:
            return super().predict_step(*args)
        return self.inner_model.predict_step(*args)

    @property
    def metrics(self):
        if getattr(self, "_custom_steps", None):
            return self.inner_model.metrics  # the ones the inner model's own steps update and report
        return super().metrics

    def _plan_for(self, inputs, kwargs):
        key = self._offload.signature_of(inputs, kwargs)
        plan = self._plans.get(key)
        if plan is None:
            batch = batching.leading_dim(inputs)
            if batch is not None and self._batch_hint is None:
                self._batch_hint = batch
            kwargs = {k: v for k, v in kwargs.items() if k != "_extra_args"}
            self._offload_depth += 1  # the trace calls the inner model: no offloading inside it
            try:
                plan = self._plan_step(inputs, kwargs, self._batch_hint or 1).entries
            finally:
                self._offload_depth -= 1
            memory.check_host_memory(planning.host_bytes_per_step(plan))
            self._plans[key] = plan
        return plan

    def _plan_step(self, inputs, kwargs, batch_size: int) -> planning.StepPlan:
        return planning.plan_step(self._offload, self.inner_model, self._structure, self.lms_config, inputs, kwargs,
                                  batch_size, getattr(self, "optimizer", None))

    def static_bytes(self) -> int:
        """Device bytes of weights, gradients and optimizer state (the planner's non-activation memory)."""
        return planning.static_bytes(self.inner_model, self._offload.memory_facts(), getattr(self, "optimizer", None))

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.fit`; first notes the batch size that will arrive, which the offload plan needs.

        Keras traces the step with an unknown batch axis for `tf.data` without `drop_remainder`, Python
        generators and PyDataset inputs; a plan sized for one sample would offload too little, report too
        little and skip the host-memory guard. The first batch is read ahead (a generator is given back with
        that batch re-inserted; `tf.data` batches are at most as large as the first). When a generator later
        yields a larger batch, the step is re-planned (and re-checked against host memory) before the next step.
        """
        x, hint = batching.peek_batch_size(x, batch_size, self)
        if hint is not None:
            self.batch_size_hint = hint
        if isinstance(x, types.GeneratorType):
            bound = inspect.signature(keras.Model.fit).bind(self, x, y, batch_size, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self")
            extra = arguments.pop("kwargs", {})
            callbacks = arguments.get("callbacks") or []
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.append(batching.Replan(self))
            else:
                arguments["callbacks"] = [*callbacks, batching.Replan(self)]
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
            self._example_plans.clear()

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
        # Why a cache: with a device_budget, wrap() plans at batch size 1 (to refuse a budget early) and lms_plan
        # asked for the same plan again, seconds of planning each for a large 3D model. What the plan depends on
        # besides the model's calls: the static bytes (weights made trainable or frozen, a built optimizer's
        # state) and the optimizer (its update's temporaries).
        optimizer = getattr(self, "optimizer", None)
        key = (batch_size, self.static_bytes(), type(optimizer).__name__, id(optimizer))
        if key not in self._example_plans:
            self._example_plans[key] = self._plan_step(specs, {}, batch_size).entries
        return self._example_plans[key]

    @property
    def lms_plan(self) -> list:
        """One PlanEntry per layer call of the last traced training step.

        Before the first training step it is the plan at batch size 1 (bytes are then per sample).
        """
        if self._last_plan is None:
            self._last_plan = self.plan(batch_size=1)
        return self._last_plan

    # Plans are per input signature and sized for the world they were made in (the host-RAM guard counts the
    # ranks on the node): an elastic commit saves them with the weights, a reset forgets them.
    def plan_cache(self) -> tuple:
        """A copy of the cached offload plans and the last plan (`keras_lms.horovod.elastic` commits it)."""
        return dict(self._plans), self._last_plan

    def restore_plan_cache(self, cache: tuple) -> None:
        """Put back what `plan_cache()` returned (an elastic restore)."""
        plans, last = cache
        self._plans = dict(plans)
        self._last_plan = last

    def forget_plans(self) -> None:
        """Drop every cached plan: the next training step re-plans and re-runs the host-memory guard."""
        self._plans = {}
        self._example_plans = {}

    @property
    def offloaded_bytes_per_step(self) -> int:
        """Host bytes of the last traced training step (each offloaded tensor counted once)."""
        return planning.host_bytes_per_step(self._last_plan or [])

    # ---------------------------------------------------------------- compiling
    def compile(self, *args, jit_compile="auto", **kwargs):
        # TensorFlow and torch refuse XLA (it ignores host placement); on JAX the offload is built for XLA.
        jit_compile = self._offload.resolve_jit_compile(jit_compile)
        super().compile(*args, jit_compile=jit_compile, **kwargs)
        if self._custom_steps:
            # The inner model's own steps read its compile state: give it the same optimizer object (one set of
            # slots, shared by both), loss and metrics. See Note: [custom train steps].
            bound = inspect.signature(keras.Model.compile).bind(self, *args, **kwargs)
            bound.arguments.pop("self")
            bound.arguments["optimizer"] = self.optimizer
            self.inner_model.compile(**bound.arguments, jit_compile=jit_compile)

    def compile_from_config(self, config):
        """Re-compile on load (Keras skips this for models that override `compile`)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def jit_compile(self):
        return getattr(self, "_lms_jit_compile", False)

    @jit_compile.setter
    def jit_compile(self, value):
        # Keras' Trainer assigns jit_compile in compile(); the back end says what a wrapped model can run under
        # (Keras' private `_jit_compile` is read only by the Trainer getter this class overrides).
        self._lms_jit_compile = self._offload.resolve_jit_compile(value)

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


def custom_step_methods(model) -> list:
    """The names in STEP_METHODS that `model`'s class overrides (Keras' own models override none)."""
    return [name for name in STEP_METHODS if getattr(type(model), name, None) is not getattr(keras.Model, name)]
