"""The options grappler optimises the wrapped training step with: its own swaps kept out.

Why: on a GPU, grappler's memory optimizer (``SwappingPass`` in ``memory_optimizer.cc``) estimates the optimised
graph's peak and, where the estimate exceeds the device, inserts swaps of its own (``_CopyFromGpuToHost`` /
``_CopyFromHostToGpu`` pairs). The wrapped step already has a plan for what lives where, made for the device
budget; grappler's estimate of that step is not the step (it counts the slab windows' layout copies and the top
of the backward with tensors that never coexist), so at the largest volumes it swaps a step that fits. Simulated
on a 16 GiB GPU (``benchmarks/simulated_gpu_peak.py --like-for-like``): the 3D U-Net's 528^3 mixed_float16 plan
peaks at 14.33 GiB as planned, but grappler's estimate (18.02 GiB) made it swap 366 tensors, 87.9 GiB each way,
and the step no longer fit; at 416^3 float32 it swapped 13 tensors, 4.84 GiB each way, for nothing (14.25 ->
14.15 GiB). Issue 26 asks to keep wrapped graphs from triggering them unless they help; they never lower the peak
of a plan that fits its budget, so they are kept out of every wrapped training step.

How: TensorFlow passes the calling thread's ``FunctionCallOptions`` (a ``ConfigProto``) as the ``config_proto``
attribute of every function call (``Context.call_function``); the function runtime optimises a function with the
config of its first call, and a nested function call traced inside it records the config it was traced under.
Set around the wrapped model's train-function calls only (``LMSModel.make_train_function``), the memory
optimizer runs at ``SCHEDULING_HEURISTICS``: its scheduling pass (``AddN`` rewritten to accumulate) stays, its
swapping pass does not run. No other ``tf.function`` of the process changes, where
``tf.config.optimizer.set_experimental_options`` would change them all. A user's own setting other than the
swapping ones (``NO_MEM_OPT``, ``MANUAL``, ``RECOMPUTATION_HEURISTICS``, ``SCHEDULING_HEURISTICS``) is left as is.

Private TensorFlow API (``tensorflow.python.eager.context``: ``Context.function_call_options`` and
``FunctionCallOptions``); ``check()`` raises naming it where TensorFlow no longer has it, and
``tests/offload/tensorflow/test_call_options.py`` shows the options reach grappler in the executed graph.
"""

from __future__ import annotations

import contextlib

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

RewriterConfig = rewriter_config_pb2.RewriterConfig

# Settings of memory_optimization under which the memory optimizer's swapping heuristics run (MANUAL swaps only
# what a user annotated, and is left alone).
SWAPPING = (RewriterConfig.DEFAULT_MEM_OPT, RewriterConfig.SWAPPING_HEURISTICS, RewriterConfig.HEURISTICS)
# What the wrapped step runs at instead: scheduling (AddN accumulation) on, swapping off.
WITHOUT_SWAPS = RewriterConfig.SCHEDULING_HEURISTICS
# Control: False leaves grappler's swaps in wrapped steps (tests and benchmarks compare both).
KEEP_GRAPPLER_SWAPS_OUT = True


def check() -> None:
    """Raise ``RuntimeError`` naming the private TensorFlow API this module needs where it is gone."""
    ctx = context.context()
    if not hasattr(context, "FunctionCallOptions") or not isinstance(
            getattr(type(ctx), "function_call_options", None), property) or type(
            ctx).function_call_options.fset is None:
        import tensorflow as tf

        raise RuntimeError(
            "keras_lms.offload.tensorflow.call_options relies on tensorflow.python.eager.context's "
            f"FunctionCallOptions and Context.function_call_options (a settable property), which TensorFlow "
            f"{tf.__version__} does not have; set call_options.KEEP_GRAPPLER_SWAPS_OUT = False to train without "
            "it, and report the TensorFlow version.")


def swap_free(memory_optimization: int) -> int:
    """The memory optimizer's setting for a wrapped step, given the one the process runs with."""
    return WITHOUT_SWAPS if memory_optimization in SWAPPING else memory_optimization


def wrapped_step_setting(memory_optimization: int) -> int:
    """What a wrapped step runs at, given the process's setting: ``swap_free`` of it, or it as it is with the
    control off (the simulator asks this too, ``simulated_gpu.step_memory_optimization``)."""
    return swap_free(memory_optimization) if KEEP_GRAPPLER_SWAPS_OUT else memory_optimization


def swaps_in_wrapped_step() -> bool:
    """Whether grappler's swapping heuristics would run in a wrapped step called from this thread now: only with
    the control off and the thread's setting one that swaps (TensorFlow's default among them). The planner asks
    (``grappler_estimate.room_for_keeps``) when it plans, so a setting changed between ``wrap`` and ``fit`` is not
    seen."""
    current = config_pb2.ConfigProto.FromString(context.context().function_call_options.config_proto_serialized)
    return wrapped_step_setting(current.graph_options.rewrite_options.memory_optimization) in SWAPPING


@contextlib.contextmanager
def rewritten_calls(edit):
    """Function calls made inside run with the calling thread's grappler options edited by ``edit`` (called with
    the ``RewriterConfig`` of a copy of the current ``ConfigProto``); the thread's options are restored after."""
    ctx = context.context()
    before = ctx.function_call_options
    config = config_pb2.ConfigProto.FromString(before.config_proto_serialized)
    edit(config.graph_options.rewrite_options)
    ctx.function_call_options = context.FunctionCallOptions(executor_type=before.executor_type,
                                                            config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = before


def without_grappler_swaps():
    """The scope the wrapped training step is called in (module docstring); a no-op with the control off."""
    if not KEEP_GRAPPLER_SWAPS_OUT:
        return contextlib.nullcontext()
    check()

    def edit(rewrite):
        rewrite.memory_optimization = wrapped_step_setting(rewrite.memory_optimization)

    return rewritten_calls(edit)
