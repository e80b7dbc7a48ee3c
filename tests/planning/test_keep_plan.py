"""The keep search (``planning.keep_plan``): offloaded calls kept on the device where the budget has room, chosen
by the time their copies cost."""

import pytest

from keras_lms.planning import keep_plan

# four offloaded calls; keeping call i saves GAIN[i] seconds and costs ROOM[i] bytes of the budget's room
GAIN = {0: 0.010, 1: 0.030, 2: 0.0, 3: 0.020}
ROOM = {0: 5, 1: 8, 2: 1, 3: 4}
OFFLOADED = [[True], [True, False], [True], [True]]


def step_seconds(rows):
    return 1.0 - sum(GAIN[i] for i, row in enumerate(rows) if not any(row))


def fits_within(room):
    return lambda rows: sum(ROOM[i] for i, row in enumerate(rows) if not any(row)) <= room


def test_the_calls_whose_copies_cost_most_are_kept_while_they_fit():
    kept = keep_plan.calls_to_keep(OFFLOADED, step_seconds, fits_within(12))
    assert list(kept) == [1, 3]  # best first; 0 no longer fits beside them; 2 saves nothing
    assert kept == pytest.approx({1: 0.030, 3: 0.020})


def test_nothing_is_kept_without_room_or_without_a_gain():
    assert keep_plan.calls_to_keep(OFFLOADED, step_seconds, fits_within(0)) == {}  # the control: no room
    assert keep_plan.calls_to_keep(OFFLOADED, lambda rows: 1.0, fits_within(100)) == {}  # no gain


def test_only_candidates_are_tried_and_kept_rows_keep_every_input():
    assert list(keep_plan.calls_to_keep(OFFLOADED, step_seconds, fits_within(100), candidates={0, 3})) == [3, 0]
    assert keep_plan.kept_row(OFFLOADED, [1]) == [[True], [False, False], [True], [True]]


def test_a_gain_below_the_models_resolution_keeps_nothing():
    def barely(rows):
        return 1.0 - 0.5 * keep_plan.MIN_GAIN * sum(not any(row) for row in rows)

    assert keep_plan.calls_to_keep(OFFLOADED, barely, fits_within(100)) == {}
