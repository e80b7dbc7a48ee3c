"""What the back ends share (keras_lms/offload/common.py): a call that differs from the plan is decided on the
spot, and what the planning trace found the back end cannot offload still holds for it."""

from __future__ import annotations

import types

import keras

from keras_lms.config import LMSConfig
from keras_lms.offload import common
from keras_lms.planning import PlanEntry


class _Context(common.InterceptingContext):
    tensor_bytes = staticmethod(lambda tensor: tensor)  # a "tensor" here is its size
    tensor_rank = staticmethod(lambda tensor: 2)


def _entry(index, layer, unoffloadable=None):
    return PlanEntry(index=index, layer=layer, layer_class="Dense", shapes=[(None, 8)], dtypes=["float32"], bytes=32,
                     offloaded=unoffloadable is None, reason=f"kept: {unoffloadable}" if unoffloadable else "off",
                     tensor_offloaded=[unoffloadable is None], unoffloadable=unoffloadable)


def test_a_call_off_the_plan_keeps_what_the_trace_found():
    proj, other = keras.layers.Dense(2, name="proj"), keras.layers.Dense(2, name="other")
    structure = types.SimpleNamespace(unit_models={})
    plan = [_entry(0, "proj", "reads trainable variables of other layers (encode/kernel)"), _entry(1, "other")]
    ctx = _Context(LMSConfig(min_bytes=0, keep_last=0), structure, plan, eager=True, host="/CPU:0")
    # calls in another order than planned: decided on the spot (one warning), the finding still applies
    assert ctx._decision(0, other, [4096]).offloaded
    kept = ctx._decision(1, proj, [4096])
    assert not kept.offloaded and kept.reason == "kept: reads trainable variables of other layers (encode/kernel)"
    fresh = _Context(LMSConfig(min_bytes=0, keep_last=0), structure, [_entry(1, "other")], eager=True, host="/CPU:0")
    assert fresh._decision(1, proj, [4096]).offloaded  # control: without the finding it would be offloaded
