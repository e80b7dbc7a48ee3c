"""The only package that touches private Keras API.

keras-lms needs these things Keras 3 does not expose publicly; each submodule covers one area of Keras internals
and its docstring says which internals it relies on and why:

* :mod:`.stateless`: run a layer's *original* ``call`` statelessly while collecting only the losses that ``call``
  adds (``Layer.stateless_call(return_losses=True)`` also returns weight-regularisation losses, which Keras adds
  again from ``model.losses``; counting them twice would change the loss), read a variable's stored value without
  the mixed-precision autocast that is active inside a layer call, and note which variables a call reads;
* :mod:`.calls`: intercept a layer call *after* ``Layer.__call__`` has resolved ``training``, masks and
  autocasting, by shadowing the bound ``call`` method on the instance for the duration of one forward pass, and
  re-enter, in the backward recompute, the Keras call context (``training`` and the other call-context
  arguments) that the forward call ran under (:class:`CallInContext`);
* :mod:`.graphs`: list a functional graph's operations, infer output specs without leaking state between the
  torch meta and real-tensor attempts, and run functional graphs that drop each intermediate tensor after its
  last consumer (:func:`releasing_graph_runs`);
* :mod:`.layers`: read and attach Keras masks, clear the losses a throw-away planning trace left on the layers,
  and, on TensorFlow, replay BatchNormalization's batch statistics and a Dense/Conv layer's pre-activation in the
  recompute (:func:`batchnorm_moments_hook`, :func:`batchnorm_reduction_axes`, :func:`fused_activation`), and
  run a convolution's own call unpadded on a slab it padded itself (:func:`valid_convolution`);
* :mod:`.torch_trees`: on torch, flatten nested structures without the reference cycles Keras' torch tree
  utilities create (:func:`acyclic_torch_trees`), so a tensor dies when its last user drops it, not at the next
  garbage collection;
* :mod:`.training`: for ``keras_lms.BackupAndRestore``, make a running ``fit`` start at a given epoch
  (:func:`set_initial_epoch`) and pass over the batches an interrupted run had trained
  (:func:`skipping_train_function`);
* :mod:`.optimizers`: for ``keras_lms.horovod``, key, list and save an optimizer's variables as Keras does
  (:func:`optimizer_variable_key`, :func:`optimizer_trainable_variables`, :func:`serialize_like`) and find
  RMSprop's momentum buffers (:func:`rmsprop_momentums`).

No other module of keras-lms imports ``keras.src`` or reads a private attribute of a Keras object
(``tests/test_keras_adapter.py`` greps the sources). Everything here is pinned to the Keras range in
pyproject.toml, checked when this package is imported (before any submodule imports ``keras.src``);
``tests/test_keras_adapter.py`` (and ``tests/offload/torch/test_keras_adapter.py`` for the torch back end) has a canary
per assumption that fails loudly, naming the function, when a Keras release changes one; a private attribute that
is gone raises :class:`RuntimeError` naming the function and the Keras versions.

Callers use the names re-exported here, looked up on this package at call time (``adapter.run_stateless(...)``),
so a benchmark or test that replaces one here (``_keras_adapter.acyclic_torch_trees = contextlib.nullcontext``)
changes what every caller runs. No function of the adapter calls another one that is patched that way.
"""

from __future__ import annotations

from keras_lms._keras_support import SUPPORTED_KERAS, check_keras_version, is_quantized, patched_attribute

check_keras_version()  # the version gate: the submodules below rely on this Keras range's internals

from keras_lms._keras_adapter.calls import CallInContext, original_call, patched_calls  # noqa: E402
from keras_lms._keras_adapter.graphs import (  # noqa: E402
    _functional_graphs as _functional_graphs,  # tests/offload/torch/test_machinery.py checks the patched graphs
)
from keras_lms._keras_adapter.graphs import (  # noqa: E402
    compute_output_spec,
    functional_operations,
    releasing_graph_runs,
)
from keras_lms._keras_adapter.layers import (  # noqa: E402
    batchnorm_moments_hook,
    batchnorm_reduction_axes,
    clear_losses,
    fused_activation,
    get_mask,
    replaced_convolution,
    set_mask,
    valid_convolution,
)
from keras_lms._keras_adapter.optimizers import (  # noqa: E402
    optimizer_trainable_variables,
    optimizer_variable_key,
    rmsprop_momentums,
    serialize_like,
)
from keras_lms._keras_adapter.stateless import (  # noqa: E402
    StatelessScope as StatelessScope,  # the canary checks run_stateless's scope is the public keras.StatelessScope
)
from keras_lms._keras_adapter.stateless import (  # noqa: E402
    current_autocast_dtype,
    raw_values,
    recording_variable_reads,
    run_stateless,
)
from keras_lms._keras_adapter.torch_trees import acyclic_torch_trees  # noqa: E402
from keras_lms._keras_adapter.training import (  # noqa: E402
    build_compiled_metrics,
    can_skip_train_steps,
    global_seed_generator,
    initial_epoch,
    set_initial_epoch,
    skipping_train_function,
)

__all__ = [  # the last line: re-exported from keras_lms._keras_support (public Keras API only)
    "current_autocast_dtype", "run_stateless", "raw_values", "recording_variable_reads", "original_call",
    "CallInContext", "patched_calls", "clear_losses", "functional_operations", "get_mask", "set_mask",
    "compute_output_spec", "releasing_graph_runs", "acyclic_torch_trees", "batchnorm_moments_hook",
    "batchnorm_reduction_axes", "fused_activation", "valid_convolution", "replaced_convolution",
    "optimizer_variable_key", "optimizer_trainable_variables",
    "rmsprop_momentums", "serialize_like", "initial_epoch", "set_initial_epoch", "can_skip_train_steps",
    "skipping_train_function", "global_seed_generator", "build_compiled_metrics",
    "SUPPORTED_KERAS", "check_keras_version", "is_quantized", "patched_attribute",
]
