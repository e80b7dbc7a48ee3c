"""The short-chain search (``planning.chain_plan.choose_short_chains``) on stand-in step and budget functions:
it takes what fits and saves time, best first, and nothing else."""

from keras_lms.planning.chain_plan import choose_short_chains

SAVED = {3: 0.010, 7: 0.004, 9: 0.0}  # seconds each short chain saves alone, on a 1 s step


def seconds(short):
    return 1.0 - sum(SAVED[r] for r in short)


def test_takes_the_chains_that_fit_and_save_time():
    assert choose_short_chains(SAVED, seconds, lambda short: True) == {3, 7}  # 9 saves nothing


def test_a_chain_that_does_not_fit_is_left_out():
    assert choose_short_chains(SAVED, seconds, lambda short: 3 not in short) == {7}


def test_best_first_when_only_one_fits():
    assert choose_short_chains(SAVED, seconds, lambda short: len(short) <= 1) == {3}


def test_nothing_without_room_or_candidates():
    assert choose_short_chains(SAVED, seconds, lambda short: not short) == frozenset()
    assert choose_short_chains({}, seconds, lambda short: True) == frozenset()
