"""runtime.distributed.balanced_assignment: shards dealt to ranks by their work (longest first, to the least loaded
rank), against the round-robin it replaced."""

from __future__ import annotations

import random

from runtime.distributed import balanced_assignment


def loads(work, assignment):
    return [sum(work[i] for i in rank) for rank in assignment]


def round_robin(n, world):
    return [list(range(r, n, world)) for r in range(world)]


def test_every_shard_exactly_once_in_index_order():
    rng = random.Random(5)
    for world in (1, 2, 3, 8):
        work = [rng.randint(1, 1000) for _ in range(rng.randint(0, 30))]
        dealt = balanced_assignment(work, world)
        assert len(dealt) == world
        assert sorted(i for rank in dealt for i in rank) == list(range(len(work)))
        assert all(rank == sorted(rank) for rank in dealt)


def test_deterministic_whatever_the_ties():
    work = [5, 5, 5, 5, 3, 3, 9, 0]
    first = balanced_assignment(work, 3)
    assert all(balanced_assignment(list(work), 3) == first for _ in range(5))
    # by hand, most work first, each to the least loaded rank (ties: the lowest): 9 -> r0; 5, 5 -> r1, r2; 5 -> r1
    # (r1, r2 tie at 5); 5 -> r2; 3 -> r0 (9); 3 -> r1 (r1, r2 tie at 10); 0 -> r2 (loads 12, 13, 10)
    assert first == [[4, 6], [0, 2, 5], [1, 3, 7]]
    assert loads(work, first) == [12, 13, 10]


def test_balances_skewed_lengths_where_round_robin_does_not():
    # long shards at even positions (data sorted by source, say): round-robin puts every long shard on rank 0
    work = [1000, 10] * 6
    rr = loads(work, round_robin(len(work), 2))
    lpt = loads(work, balanced_assignment(work, 2))
    assert rr == [6000, 60]
    assert lpt == [3030, 3030]
    rng = random.Random(11)
    for _ in range(50):
        work = [int(rng.paretovariate(1.2) * 100) for _ in range(rng.randint(2, 40))]
        for world in (2, 4):
            got = loads(work, balanced_assignment(work, world))
            # greedy's bound: no rank above the mean by more than one shard; and never worse than round-robin's max
            assert max(got) <= sum(work) / world + max(work)
            assert max(got) <= max(loads(work, round_robin(len(work), world)))


def test_more_ranks_than_shards_leaves_some_ranks_none():
    assert balanced_assignment([7, 3], 4) == [[0], [1], [], []]
    assert balanced_assignment([], 2) == [[], []]
    assert balanced_assignment([4, 2, 9], 1) == [[0, 1, 2]]
