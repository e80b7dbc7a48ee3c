"""The memory model on hand-built calls (no tracing): timelines worked out by hand, and the back end's facts
changing exactly the terms they name."""

from __future__ import annotations

import dataclasses
import types

import keras
import pytest

from keras_lms.planning import BackendFacts, memory_model
from tests.planning.calls import floats, raw_call

FACTS = BackendFacts()


def dense_chain():
    """x (100 B) -> d1 -> y1 (200 B) -> d2 -> y2 (50 B), batch 1."""
    return [raw_call(keras.layers.Dense(50, name="d1"), [("x", floats(25))], [("y1", floats(50))]),
            raw_call(keras.layers.Dense(12, name="d2"), [("y1", floats(50))], [("y2", floats(12))])]


def test_plain_chain_timeline_by_hand():
    # positions: 0 d1 forward, 1 d2 forward, 2 d2 backward, 3 d1 backward
    # x lives until d1's backward, y1 until d2's backward, y2 (the output) until the loss's backward starts;
    # each backward also holds its input and output gradients: d2 200 + 48, d1 100 + 200.
    memory = memory_model.simulate(dense_chain(), [[False], [False]], FACTS)
    assert memory.timeline == [100 + 200, 100 + 200 + 48, 100 + 200 + 48 + 248, 100 + 300]


def test_offloaded_input_leaves_the_device_until_its_swap_in():
    # x offloaded: freed after d1's forward, back (prefetch 1: triggered by d2's backward, a matmul, so it lands
    # during it) from position 2 to d1's backward at 3.
    memory = memory_model.simulate(dense_chain(), [[True], [False]], FACTS)
    assert memory.timeline == [100 + 200, 200 + 48, 100 + 200 + 48 + 248, 100 + 300]
    without_prefetch = memory_model.simulate(dense_chain(), [[True], [False]], FACTS, prefetch=0)
    assert without_prefetch.timeline[2] == 200 + 48 + 248  # brought back only for d1's own backward


def test_static_and_update_bytes_are_added_to_the_peak():
    memory = memory_model.simulate(dense_chain(), [[False], [False]], FACTS, static_bytes=1000, update_bytes=10)
    assert memory.peak_bytes == 1000 + 596
    assert memory.budget_bytes == 1000 + int(596 * memory_model.BUDGET_MARGIN)
    assert memory_model.simulate([], [], FACTS, static_bytes=7).peak_bytes == 7


def test_output_differentiated_activation_keeps_only_its_output():
    calls = [raw_call(keras.layers.Dense(50, name="d1"), [("x", floats(25))], [("y1", floats(50))]),
             raw_call(keras.layers.ReLU(name="r"), [("y1", floats(50))], [("y2", floats(50))])]
    generic = memory_model.simulate(calls, [[False], [False]], FACTS)

    class ReluFromOutput(BackendFacts):
        output_gradient_activations = frozenset({"relu"})

    from_output = memory_model.simulate(calls, [[False], [False]], ReluFromOutput())
    assert FACTS.backward_reads(calls[1].unit) == (True, False)
    assert ReluFromOutput().backward_reads(calls[1].unit) == (False, True)
    # x (100) lives to d1's backward, y2 (200, the output) to r's backward; r's backward holds 200 + 200 of
    # gradients. Read from its input, r keeps y1 (200) until its backward; read from its output, y1 is freed
    # after r's forward (d1's backward reads x, not y1).
    assert generic.timeline == [100 + 200, 100 + 200 + 200, 100 + 200 + 200 + 400, 100 + 300]
    assert from_output.timeline == [100 + 200, 100 + 200 + 200, 100 + 200 + 400, 100 + 300]


@pytest.mark.parametrize("fact,changed_position", [("recomputes_offloaded_calls", 2),
                                                   ("copy_back_allocated_at_trigger", None)])
def test_each_fact_changes_its_own_term(fact, changed_position):
    base = memory_model.simulate(dense_chain(), [[True], [True]], FACTS)
    facts = type("Changed", (BackendFacts,), {fact: True})()
    changed = memory_model.simulate(dense_chain(), [[True], [True]], facts)
    if changed_position is None:  # both triggers are matmuls: the copy lands during them anyway
        assert changed.timeline == base.timeline
    else:  # d2 recomputes its 48-byte output in its backward
        assert changed.timeline[changed_position] == base.timeline[changed_position] + 48


def test_static_bytes_count_weights_gradients_slots_and_the_back_ends_extra():
    variable = types.SimpleNamespace(shape=(10, 10), dtype="float32")
    frozen = types.SimpleNamespace(shape=(5,), dtype="float32")
    model = types.SimpleNamespace(variables=[variable, frozen], trainable_variables=[variable])

    class Extra(BackendFacts):
        def static_extra_bytes(self, model, optimizer=None, default_slots=2):
            return 1

    # weights 420, gradients 400, Adam-like slots 2 x 400, extra 1
    assert memory_model.static_bytes(model, Extra()) == 420 + 400 + 800 + 1
    assert memory_model.variable_bytes([types.SimpleNamespace(shape=(3,), dtype="bfloat16")]) == 6


def skip_chain():
    """x (100 B) -> d1 -> y1 (200 B) -> d2 -> y2 (200 B); add(y1, y2) -> z (200 B): y1 has two readers."""
    return [raw_call(keras.layers.Dense(50, name="d1"), [("x", floats(25))], [("y1", floats(50))]),
            raw_call(keras.layers.Dense(50, name="d2"), [("y1", floats(50))], [("y2", floats(50))]),
            raw_call(keras.layers.Add(name="add"), [("y1", floats(50)), ("y2", floats(50))], [("z", floats(50))])]


def test_a_gradient_in_parts_waits_and_its_sum_is_a_new_buffer():
    """y1's gradient arrives in two parts: the Add's (position 3) and d2's (position 4). The Add's part waits
    through d2's backward; a back end that sums into a new buffer (TensorFlow's AddN) also holds the sum there."""
    calls = skip_chain()
    base = memory_model.simulate(calls, [[False], [False], [False, False]], FACTS)
    waiting = type("Waiting", (BackendFacts,), {"gradients_wait_between_readers": True})()
    summed = type("Summed", (BackendFacts,), {"gradients_wait_between_readers": True,
                                              "gradient_sum_allocated": True})()
    waits = memory_model.simulate(calls, [[False], [False], [False, False]], waiting)
    sums = memory_model.simulate(calls, [[False], [False], [False, False]], summed)
    assert [w - b for w, b in zip(waits.timeline, base.timeline)] == [0, 0, 0, 0, 200, 0]
    assert [s - b for s, b in zip(sums.timeline, base.timeline)] == [0, 0, 0, 0, 400, 0]


@dataclasses.dataclass(frozen=True)
class _Sweep:
    first: int
    calls: tuple
    windows: int = 4
    held: tuple = ()
    hold_options: tuple = ((1,),)


class _SweptFacts(BackendFacts):
    """Both calls of the dense chain computed in slabs (their backward holding 1000 B) and one sweep over both,
    whose backwards hold ``windows`` + 3 and 11 B (what ``sweep_backward_bytes`` says)."""

    def slab_plans(self, calls, offloaded, batch_size, slab_bytes):
        return {0: "plan", 1: "plan"} if slab_bytes else {}

    def slab_backward_bytes(self, call, input_sizes, output_sizes, slab):
        return 1000

    def slab_sweeps(self, calls, offloaded, slabs):
        return [_Sweep(first=0, calls=(0, 1))]

    def sweep_backward_bytes(self, calls, sweep, slabs, input_sizes, output_sizes):
        return {0: sweep.windows + 3 + 100 * len(sweep.held), 1: 11}


def test_a_sweeps_calls_hold_what_the_back_end_says_in_their_backward():
    offloaded = [[True], [True]]
    slabbed = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1)
    swept = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1, swept={0: None})
    thicker = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1, swept={0: 8})
    other = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1, swept={5: 8})
    assert other.timeline == slabbed.timeline  # a sweep the plan does not run changes nothing
    assert [b - s for b, s in zip(slabbed.timeline, swept.timeline)] == [0, 0, 1000 - 11, 1000 - 7]
    assert [t - s for t, s in zip(thicker.timeline, swept.timeline)] == [0, 0, 0, 4]  # the planned windows
    held = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1, swept={0: (8, (1,))})
    unknown = memory_model.simulate(dense_chain(), offloaded, _SweptFacts(), slab_bytes=1, swept={0: (8, (2,))})
    assert [h - t for h, t in zip(held.timeline, thicker.timeline)] == [0, 0, 0, 100]  # the planned held units
    assert unknown.timeline == thicker.timeline  # a unit the sweep cannot hold is not held
