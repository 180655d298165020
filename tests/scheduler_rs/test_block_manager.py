import pytest

from scheduler_rs import BlockManager


def test_drawer_example_free_list_gives_7_2_then_a_new_block():
    # Walkthrough Pass 1: the clerk's free list says drawers 7 and 2 are free, so a 6-token prompt in
    # 4-token drawers gets [7, 2]; position 8 later takes the next free drawer.
    pool = BlockManager(10)
    held = [pool.allocate() for _ in range(9)]
    assert held == list(range(1, 10))
    for block in (7, 2, 5):
        pool.free(block)
    table = [pool.allocate() for _ in range(-(-6 // 4))]
    assert table == [7, 2]
    assert pool.allocate() == 5  # position 8 needs a third drawer
    assert pool.allocate() is None


def test_block_zero_is_reserved_and_double_free_is_an_error():
    pool = BlockManager(3)
    assert pool.num_total == 2
    with pytest.raises(ValueError, match="block 0 is out of range"):
        pool.free(0)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(ValueError, match="not held"):
        pool.free(block)


def test_shared_block_returns_at_count_zero_to_the_tail():
    pool = BlockManager(4)
    first, second = pool.allocate(), pool.allocate()
    pool.incref(first)
    assert pool.ref_count(first) == 2
    pool.free(first)
    assert pool.free_ids() == [3]
    pool.free(first)
    pool.free(second)
    assert pool.free_ids() == [3, first, second]
