"""The gateway's index of the engines' cached blocks: events applied in order, overlap as the leading run of a
prompt's chain, the bound, and forgetting."""

from services.gateway.prefix_index import PrefixIndex


def test_overlap_is_the_leading_run_of_the_chain_a_replica_holds():
    index = PrefixIndex()
    index.apply("a", stored=[1, 2, 3], removed=[], cleared=False)
    index.apply("b", stored=[1, 3, 4], removed=[], cleared=False)
    assert index.overlap("a", [1, 2, 3, 4]) == 3
    assert index.overlap("b", [1, 2, 3, 4]) == 1  # holds 3 and 4, but not 2: only block 0 is a usable prefix
    assert index.overlap("a", [9, 1, 2]) == 0
    assert index.overlap("never-heard", [1]) == 0 and not index.heard("never-heard")
    assert index.holders(1) == {"a", "b"} and index.holders(2) == {"a"} and index.holders(7) == set()


def test_cleared_then_removed_then_stored():
    index = PrefixIndex()
    index.apply("a", stored=[1, 2, 3], removed=[], cleared=False)
    index.apply("a", stored=[5], removed=[2], cleared=False)
    assert index.overlap("a", [1, 2]) == 1 and index.overlap("a", [5]) == 1
    index.apply("a", stored=[2], removed=[2], cleared=False)  # evicted, then stored again in one batch
    assert index.overlap("a", [1, 2]) == 2
    index.apply("a", stored=[7], removed=[], cleared=True)
    assert index.num_blocks("a") == 1 and index.overlap("a", [1]) == 0 and index.overlap("a", [7]) == 1
    assert index.heard("a")  # cleared, but still publishing: its (empty) cache counts


def test_the_bound_drops_the_oldest_and_a_restored_hash_is_newest():
    index = PrefixIndex(max_blocks_per_replica=3)
    index.apply("a", stored=[1, 2, 3], removed=[], cleared=False)
    index.apply("a", stored=[1], removed=[], cleared=False)  # 1 is now the newest
    index.apply("a", stored=[4], removed=[], cleared=False)
    assert index.num_blocks("a") == 3 and index.num_dropped == 1
    assert index.overlap("a", [1]) == 1 and index.overlap("a", [2]) == 0  # 2 was the oldest
    index.apply("a", stored=list(range(10, 20)), removed=[], cleared=False)
    assert index.num_blocks("a") == 3 and index.overlap("a", [17, 18, 19]) == 3


def test_a_forgotten_replica_holds_nothing_and_is_unheard():
    index = PrefixIndex()
    index.apply("a", stored=[1], removed=[], cleared=False)
    index.apply("b", stored=[1], removed=[], cleared=False)
    index.forget("a")
    assert not index.heard("a") and index.overlap("a", [1]) == 0 and index.holders(1) == {"b"}
    index.forget("never-heard")  # no error
