"""The closed-form pricer's group keys."""

from __future__ import annotations

import pickle

from collsim.step.pricing import HashedRanks


def test_hashed_ranks_is_the_plain_tuple_for_every_lookup() -> None:
    """A large group hashes once, and still equals, hashes and pickles as its plain tuple: a
    dict filled with one finds the other."""
    plain = tuple(range(0, 8 * 1024, 8))
    ranks = HashedRanks(plain)
    assert ranks == plain and hash(ranks) == hash(plain)
    assert {plain: "a"}[ranks] == "a" and {ranks: "b"}[plain] == "b"
    assert {("all_gather", 1.0, plain): 1}[("all_gather", 1.0, ranks)] == 1
    back = pickle.loads(pickle.dumps(ranks))
    assert back == plain and hash(back) == hash(plain)
    assert list(ranks[:2]) == [0, 8] and len(ranks) == 1024
