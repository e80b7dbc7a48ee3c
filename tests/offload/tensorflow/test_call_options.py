"""The wrapped step's grappler options (``offload/tensorflow/call_options.py``): they reach grappler in the graph
TensorFlow executes, the wrapped train function is called with grappler's swapping pass off while no other
function is, and the private TensorFlow API they rely on is there. What that does on a GPU-sized graph:
test_grappler_swaps.py (the simulator optimises a wrapped step as its train function runs)."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

import keras_lms
from keras_lms.offload.tensorflow import call_options
from tests import models

pytestmark = pytest.mark.tensorflow(reason="grappler's options are TensorFlow's")

RewriterConfig = call_options.RewriterConfig


def _function():
    @tf.function
    def f(x):
        return tf.identity(tf.identity(x)) * (tf.constant(2.0) * tf.constant(3.0))
    return f


def _executed_ops(function, scope) -> list:
    """The op types of ``function``'s partition graphs, as TensorFlow ran its first call inside ``scope``."""
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        with scope:
            function(tf.ones(3))
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return sorted(n.op for g in metadata.function_graphs for p in g.partition_graphs for n in p.node)


def test_the_options_reach_grappler_in_the_executed_graph():
    """With grappler off for one call (``rewritten_calls``), the executed graph keeps the identities and the
    constant product grappler removes and folds; the same function called outside the scope (control) and a
    call after the scope get grappler's graph: the options are the call's, and restored after it."""
    off = call_options.rewritten_calls(lambda rewrite: setattr(rewrite, "disable_meta_optimizer", True))
    function = _function()
    unoptimised = _executed_ops(function, off)
    assert unoptimised.count("Identity") >= 2 and unoptimised.count("Mul") == 2, unoptimised
    optimised = _executed_ops(_function(), contextlib.nullcontext())
    assert "Identity" not in optimised and optimised.count("Mul") == 1, optimised
    assert _executed_ops(function, contextlib.nullcontext()) == optimised  # (the same function, re-instantiated)


def _memory_optimization_of_calls(run) -> list:
    """``(function name, memory_optimization)`` of every function call ``run()`` makes (the ``config_proto`` each
    call hands the runtime, ``Context.call_function``)."""
    seen, original = [], context.Context.call_function

    def spy(self, name, inputs, num_outputs):
        config = config_pb2.ConfigProto.FromString(self.function_call_options.config_proto_serialized)
        seen.append((name.decode(), config.graph_options.rewrite_options.memory_optimization))
        return original(self, name, inputs, num_outputs)

    context.Context.call_function = spy
    try:
        run()
    finally:
        context.Context.call_function = original
    return seen


def _fit(model):
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((2, 32, 32, 1), "float32")
    model.fit(x, x, batch_size=2, epochs=1, verbose=0)


@pytest.mark.parametrize("keep_out", [True, False], ids=["swaps_out", "control"])
def test_the_wrapped_train_function_is_called_without_grappler_swaps(keep_out, monkeypatch):
    monkeypatch.setattr(call_options, "KEEP_GRAPPLER_SWAPS_OUT", keep_out)
    wrapped = keras_lms.wrap(models.unet2d(), min_bytes="16KiB")
    calls = _memory_optimization_of_calls(lambda: _fit(wrapped))
    train = [setting for name, setting in calls if "step_on_iterator" in name]
    expected = RewriterConfig.SCHEDULING_HEURISTICS if keep_out else RewriterConfig.DEFAULT_MEM_OPT
    assert train and set(train) == {expected}, calls
    # neither a plain model's train function nor a function called after the wrapped step has them
    plain = _memory_optimization_of_calls(lambda: _fit(models.unet2d()))
    after = _memory_optimization_of_calls(lambda: _function()(tf.ones(3)))
    assert {s for _, s in plain + after} == {RewriterConfig.DEFAULT_MEM_OPT}, (plain, after)


def test_a_user_setting_other_than_the_swapping_ones_is_kept():
    assert call_options.swap_free(RewriterConfig.DEFAULT_MEM_OPT) == RewriterConfig.SCHEDULING_HEURISTICS
    assert call_options.swap_free(RewriterConfig.HEURISTICS) == RewriterConfig.SCHEDULING_HEURISTICS
    assert call_options.swap_free(RewriterConfig.SWAPPING_HEURISTICS) == RewriterConfig.SCHEDULING_HEURISTICS
    for kept in (RewriterConfig.NO_MEM_OPT, RewriterConfig.MANUAL, RewriterConfig.RECOMPUTATION_HEURISTICS):
        assert call_options.swap_free(kept) == kept


def test_whether_the_wrapped_step_swaps_follows_the_setting_it_runs_at(monkeypatch):
    """``swaps_in_wrapped_step`` (which the budget planner's keep search asks, ``grappler_estimate``): never with the
    swaps kept out; with the control off, at TensorFlow's default yes, under a user's ``NO_MEM_OPT`` (the calling
    thread's options) no."""
    assert not call_options.swaps_in_wrapped_step()
    monkeypatch.setattr(call_options, "KEEP_GRAPPLER_SWAPS_OUT", False)
    assert call_options.swaps_in_wrapped_step()

    def no_memory_optimizer(rewrite):
        rewrite.memory_optimization = RewriterConfig.NO_MEM_OPT

    with call_options.rewritten_calls(no_memory_optimizer):
        assert not call_options.swaps_in_wrapped_step()
    assert call_options.swaps_in_wrapped_step()


def test_the_private_tensorflow_api_is_there_and_its_absence_is_named(monkeypatch):
    call_options.check()  # (TensorFlow has it today)
    monkeypatch.delattr(context, "FunctionCallOptions")
    with pytest.raises(RuntimeError, match="FunctionCallOptions and Context.function_call_options"):
        call_options.check()
