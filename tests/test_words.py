"""Counts in what commands print: one of a thing is singular ("ran all 1 update", not "1 updates")."""
from ggtrain.core.fit import EarlyStopping, stop_message
from ggtrain.words import count


def test_count_is_singular_for_one_only():
    assert count(1, "update") == "1 update"
    assert count(0, "window") == "0 windows"
    assert count(1000, "update") == "1,000 updates"
    assert count(2, "preference pair") == "2 preference pairs"
    assert count(3, "matrix", "matrices") == "3 matrices"


def test_a_finished_run_of_one_update_or_epoch_says_it_in_the_singular():
    assert stop_message("finished", EarlyStopping(0), 1) == "ran all 1 update"
    assert stop_message("finished", EarlyStopping(0, unit="epoch"), 1) == "ran all 1 epoch"
    assert stop_message("finished", EarlyStopping(0, unit="epoch"), 12) == "ran all 12 epochs"
