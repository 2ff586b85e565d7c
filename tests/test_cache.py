"""Graph caches: LRU order, release on eviction, variants of one key, the eviction budget,
policy validation."""

from __future__ import annotations

import pytest

from cudagraphify import CachePolicy, CudagraphifyError
from cudagraphify._cache import EagerEntry, GraphCache


class Entry:
    def __init__(self, name):
        self.name = name
        self.released = False

    def release(self):
        self.released = True


def test_lru_evicts_the_least_recently_used_and_releases_it():
    c = GraphCache(CachePolicy(max_graphs=2))
    a, b, d = Entry("a"), Entry("b"), Entry("d")
    c.put("a", a), c.put("b", b)
    assert c.get("a") == [a]
    c.touch(a)  # a is now most recent
    assert c.put("d", d) == [b]
    assert b.released and not a.released and c.get("b") == [] and c.evictions == 1


def test_variants_of_one_key_come_most_recently_used_first_and_evict_alone():
    c = GraphCache(CachePolicy(max_graphs=2))
    train, evaluate, other = Entry("train"), Entry("eval"), Entry("other")
    c.put("k", train), c.put("k", evaluate)
    assert c.get("k") == [evaluate, train]
    c.touch(train)
    assert c.get("k") == [train, evaluate]
    assert c.put("j", other) == [evaluate]  # the least recently used variant goes alone
    assert c.get("k") == [train] and evaluate.released and not train.released
    c.discard(train)
    assert c.get("k") == [] and train.released and c.evictions == 1


def test_eager_decisions_do_not_count_against_max_graphs():
    c = GraphCache(CachePolicy(max_graphs=1))
    c.put("x", EagerEntry("why")), c.put("y", EagerEntry("why"))
    g = Entry("g")
    assert c.put("g", g) == [] and len(c) == 3 and c.graphs() == [g]


def test_clear_releases_everything():
    c = GraphCache(CachePolicy())
    es = [Entry(i) for i in range(3)]
    for i, e in enumerate(es):
        c.put(i, e)
    c.clear()
    assert all(e.released for e in es) and len(c) == 0


def test_eviction_budget():
    c = GraphCache(CachePolicy(max_graphs=1, max_evictions=2))
    for i in range(3):
        c.put(i, Entry(i))
    assert c.eviction_budget_spent()


def test_a_key_evicted_twice_is_thrashing_and_discards_are_not_evictions():
    c = GraphCache(CachePolicy(max_graphs=1))
    c.put("a", Entry("a"))
    c.put("b", Entry("b"))  # a evicted once
    assert not c.thrashing("a")
    c.put("a", Entry("a"))  # b evicted once
    c.put("b", Entry("b"))  # a evicted twice
    assert c.thrashing("a") and not c.thrashing("b") and not c.thrashing("new")
    kept = c.get("b")[0]
    c.discard(kept)  # released on purpose (an invalidation, a recapture): not an eviction
    c.put("b", Entry("b"))
    c.discard(c.get("b")[0])
    assert not c.thrashing("b")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_max_graphs(bad):
    with pytest.raises(CudagraphifyError, match="max_graphs"):
        CachePolicy(max_graphs=bad)
