import gc

import pytest

from megatron_preflight.gc_budget import YOUNG, collect_rarely, fewer_collections


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_collections_are_rarer_inside_and_as_before_after_even_on_error(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold()[0] == YOUNG
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_process_that_turned_collections_off_or_down_is_left_alone(thresholds):
    for setting in ((0, 10, 10), (YOUNG * 2, 5, 5)):
        gc.set_threshold(*setting)
        with fewer_collections():
            assert gc.get_threshold() == setting
        assert gc.get_threshold() == setting


def test_a_process_the_tool_owns_keeps_rare_collections(thresholds):
    gc.set_threshold(700, 10, 10)
    assert collect_rarely() == (700, 10, 10)
    assert gc.get_threshold()[0] == YOUNG


def test_no_collections_turns_them_off_and_back_on_unless_the_process_ends():
    from megatron_preflight.gc_budget import no_collections

    assert gc.isenabled()
    with no_collections():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with no_collections(restore=False):
            pass
        assert not gc.isenabled()  # (the program exits next: no full collection of what it built)
    finally:
        gc.enable()
