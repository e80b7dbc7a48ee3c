"""Which kept calls the budget planner tries with their inputs offloaded, so that their large outputs can be
recomputed instead of copied (``planning.source_offload``), and how the greedy search takes them."""

import types

from keras_lms.config import LMSConfig
from keras_lms.planning import rules, source_offload
from keras_lms.planning.plan import CallDecision
from tests.planning.calls import floats, raw_call


def unit(name):
    return types.SimpleNamespace(name=name)


def chain():
    """image (1k floats) -> widen (16k) -> reader; half (8k) -> widen2 (16k) -> reader2; tiny (1k) -> same (1k)."""
    return [raw_call(unit("widen"), [("image", floats(1024))], [("a", floats(16384))]),
            raw_call(unit("reader"), [("a", floats(16384))], [("b", floats(8192))]),
            raw_call(unit("widen2"), [("b", floats(8192))], [("c", floats(16384))]),
            raw_call(unit("reader2"), [("c", floats(16384))], [("d", floats(1024))]),
            raw_call(unit("same"), [("d", floats(1024))], [("e", floats(1024))]),
            raw_call(unit("reader3"), [("e", floats(1024))], [("f", floats(1024))])]


def decide(*offloaded):
    return [CallDecision([i in offloaded], "test") for i in range(6)]


CONFIG = LMSConfig(min_bytes=0, keep_last=0, device_profile="h100-pcie5")


def test_candidates_are_kept_calls_with_small_inputs_whose_output_is_copied():
    calls = chain()
    policy = rules.decide_all(calls, CONFIG, 2)
    # widen: 1/16 of its output, copied by reader; widen2: half of its output (not small); same: nobody copies e
    assert source_offload.source_candidates(calls, decide(1, 3), policy, batch_size=2) == [0]
    assert source_offload.source_candidates(calls, decide(3), policy, batch_size=2) == []  # a is not copied
    assert source_offload.source_candidates(calls, decide(0, 1, 3), policy, 2) == []  # offloaded already


def test_the_users_rules_are_kept():
    """A call the user excluded (or keep_last keeps, or whose input is under min_bytes) is never offloaded to
    make its output recomputable: the move narrows nothing the rules decided."""
    calls = chain()
    for config in (LMSConfig(min_bytes=0, keep_last=0, exclude=["widen"]),
                   LMSConfig(min_bytes=5 << 10, keep_last=0)):  # the image is 4 KiB at batch size 1
        assert source_offload.source_candidates(calls, decide(1, 3), rules.decide_all(calls, config, 1), 1) == []
    assert source_offload.source_candidates(calls, decide(1, 3), rules.decide_all(calls, CONFIG, 1), 1) == [0]


def test_the_search_keeps_only_trials_that_fit_and_are_faster():
    calls = chain()
    calls[4] = raw_call(unit("widen3"), [("d", floats(512))], [("e", floats(4096))])
    decisions = decide(1, 3, 5)
    policy = rules.decide_all(calls, CONFIG, 1)
    assert source_offload.source_candidates(calls, decisions, policy, 1) == [0, 4]  # the larger output first
    tried = []

    def try_plan(trial):
        offloaded = tuple(i for i, d in enumerate(trial) if d.offloaded)
        tried.append(offloaded)
        return {(0, 1, 3, 5): (0.8, "plan with widen"), (0, 1, 3, 4, 5): None}[offloaded]

    out, plan, seconds = source_offload.offload_sources(calls, decisions, CONFIG, 1, try_plan, 1.0)
    assert tried == [(0, 1, 3, 5), (0, 1, 3, 4, 5)]  # the second trial keeps the first one taken
    assert (plan, seconds) == ("plan with widen", 0.8)
    assert out[0].offloaded and "recomputed from its host copy" in out[0].reason and not out[4].offloaded
    # slower than the plan as it is: nothing taken
    out, plan, seconds = source_offload.offload_sources(calls, decisions, CONFIG, 1, lambda t: (1.5, "x"), 1.0)
    assert plan is None and out == decisions and seconds == 1.0
