"""`KerasState`: upstream Horovod's elastic state for a Keras 3 model, committed in host memory.

Why not upstream's `horovod.tensorflow.keras.elastic.TensorFlowKerasState`: it calls Keras 2 APIs
(`optimizer.variables()` as a method, `tf.keras.backend`), and nothing in it retraces the compiled step, which
fixed the world size when it was traced. This one subclasses Horovod's `ObjectState`, so `commit`,
`check_host_updates`, `register_reset_callbacks` and the driver's host-change notices are Horovod's own code.
What a commit holds (a host copy in memory, never a file): the model's variables (weights, BatchNorm moving
statistics, Dropout seed-generator states), the optimizer's variables (slots, iteration count, loss scale), our
`DistributedOptimizer`'s aggregation buffers and counter, the wrapped model's offload plan and the user's
attributes (`batch`, `epoch`, ...).
"""

from __future__ import annotations

import keras
import numpy as np
from horovod.common import elastic as _common
from horovod.tensorflow.functions import broadcast_object

from ..model import LMSModel
from ._hvd import hvd
from .averaging import _DistributedMixin
from .ops import broadcast_variables

ObjectState = _common.ObjectState


class KerasState(ObjectState):
    """The state of a (wrapped or plain) Keras 3 model and its optimizer, committed in host memory.

    Upstream's `hvd.elastic.KerasState` for Keras 3. `commit()` copies every variable to host memory (a NumPy
    copy, no file), then checks for host updates; `restore()` puts the last commit back; `sync()` builds the
    optimizer if needed (Keras 3 optimizers create their variables lazily, and a joining worker must have the
    same list as the others or the broadcast deadlocks), broadcasts everything from rank 0 and commits. After a
    reset the compiled steps are dropped, so that the next `fit` retraces them for the new number of ranks, and
    a wrapped model re-plans its offload (the per-rank batch or the ranks on this node may have changed).

    Args:
        model: a built `keras.Model` or `keras_lms.wrap`-ped model.
        optimizer: the optimizer; defaults to `model.optimizer` (compile the model first).
        **kwargs: user attributes to keep in the state, e.g. `batch=0, epoch=0` (any picklable values).

    Returns:
        The state; pass it to a function decorated with `run` and to the callbacks.

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: the model is not built, or there is no optimizer.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_lms
    import keras_lms.horovod as hvd

    hvd.init()
    model = keras_lms.wrap(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse", jit_compile=False)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()  # builds the optimizer, takes rank 0's state, commits
    committed = model.get_weights()
    model.set_weights([w + 1 for w in committed])  # uncommitted changes ...
    state.batch = 5
    state.restore()  # ... undone, as after a lost rank
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed)) and state.batch == 0
    ```
    """

    def __init__(self, model, optimizer=None, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError("KerasState needs a keras.Model (plain or keras_lms.wrap-ped); "
                            f"got {type(model).__name__}.")
        if not model.built:
            raise ValueError("Model must be built first: call model.build(input_shape) or train one step "
                             "before creating the KerasState.")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("KerasState needs an optimizer: compile the model first, or pass optimizer=.")
        self.model = model
        self.optimizer = optimizer
        self._saved_values = None
        self._saved_plan = None
        self._take_snapshot()
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **kwargs)

    # ------------------------------------------------------------------------------------- variables
    def _ensure_optimizer_built(self) -> None:
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def tracked_variables(self) -> list:
        """Every variable a commit holds, in an order that is the same on every rank."""
        seen, out = set(), []
        distributed = _distributed(self.optimizer)
        extra = [] if distributed is None else distributed.aggregation_variables()
        for v in list(self.model.variables) + list(self.optimizer.variables) + extra:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    def _take_snapshot(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self.tracked_variables()]
        self._saved_plan = self.model.plan_cache() if isinstance(self.model, LMSModel) else None

    def _put_snapshot_back(self) -> None:
        variables = self.tracked_variables()
        if len(variables) != len(self._saved_values):  # the optimizer was built after the last commit
            self._ensure_optimizer_built()
            variables = self.tracked_variables()
        if len(variables) != len(self._saved_values):
            raise RuntimeError(
                f"KerasState.restore(): the model and optimizer now have {len(variables)} variables, the last commit "
                f"holds {len(self._saved_values)}. Variables were added after the commit (a layer built late, or the "
                "optimizer replaced); commit again after building them.")
        for v, value in zip(variables, self._saved_values):
            v.assign(value)
        if self._saved_plan is not None:
            self.model.restore_plan_cache(self._saved_plan)

    # ------------------------------------------------------------------------ Horovod's State hooks
    def save(self):
        self._take_snapshot()
        super().save()

    def restore(self):
        self._put_snapshot_back()
        super().restore()

    def sync(self):
        self._ensure_optimizer_built()
        if hvd.size() > 1:
            broadcast_variables(self.tracked_variables(), root_rank=0)
        self._take_snapshot()
        super().sync()

    def reset(self):
        """After Horovod re-formed the job: retrace the steps (the world size is traced in) and re-plan."""
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        distributed = _distributed(self.optimizer)
        if distributed is not None:
            distributed.forget_structure()  # the end-of-epoch marker's shapes: re-learnt by the retraced step
        if isinstance(self.model, LMSModel):
            self.model.forget_plans()


TensorFlowKerasState = KerasState


def _distributed(optimizer):
    """Our DistributedOptimizer inside `optimizer` (itself, or the inner one of a LossScaleOptimizer), or None."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if isinstance(candidate, _DistributedMixin):
            return candidate
    return None
