"""`admission.lease.grant` against the water-filling it shortens: where every want fits it
skips the sort (each holder is entitled to its want, and the rest is split equally);
everywhere its results must be those of the full algorithm, kept here as written."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from admission.lease import _heads_first, grant


def water_fill(
    total: int,
    want: int,
    others: list[tuple[str, int, int, int]],
    holder: str = "",
    used: int = 0,
    granted: int = 0,
) -> tuple[int, int, int, int]:
    """`grant` before its shortcut: every holder in order of (want, most held, name), each
    entitled to the smaller of its want and an equal split of what the earlier left."""
    total, want, used = max(0, total), max(0, want), max(0, used)
    held = used_sum = 0
    wants = [(want, -max(granted, used), holder)]
    for name, g, w, u in others:
        held += max(g, u)
        used_sum += u
        wants.append((max(w, u), -max(g, u), name))
    wants.sort()
    n = len(wants)
    remaining, entitled = total, 0
    for i, (w, neg_used, name) in enumerate(wants):
        share = min(w, remaining // (n - i))
        remaining -= share
        if name == holder and w == want and -neg_used == max(granted, used):
            entitled = share
    entitled += remaining // n
    free = total - held
    return max(0, min(entitled, free)), n, used_sum, max(0, min(max(entitled, used), free))


# Small numbers, so that equal wants, equal holds and sums on either side of the total
# (the shortcut's edge) are frequent; names on both sides of the holder's.
_small = st.integers(0, 12)
_others = st.lists(
    st.tuples(st.sampled_from(["a", "b", "mb", "me2", "n", "z"]), _small, _small, _small),
    max_size=6,
    unique_by=lambda o: o[0],
)


@settings(max_examples=500, deadline=None)
@given(
    total=st.one_of(st.integers(0, 40), st.integers(0, 100_000)),
    want=_small,
    used=_small,
    granted=_small,
    others=_others,
)
def test_grant_is_the_full_water_filling(
    total: int, want: int, used: int, granted: int, others: list[tuple[str, int, int, int]]
) -> None:
    expect = water_fill(total, want, others, "me", used, granted)
    assert grant(total, want, others, "me", used, granted) == expect


def test_where_every_want_fits_each_gets_its_own_and_the_rest_is_split() -> None:
    # Wants 1 + 5 + 4 (max of want and use) = 10 of 13: 3 left, 1 each.
    others = [("a", 0, 5, 0), ("b", 0, 2, 4)]
    assert grant(13, 1, others, "me") == water_fill(13, 1, others, "me") == (2, 3, 4, 2)
    # Exactly the total: nothing left over; one more and the split binds.
    assert grant(10, 1, others, "me")[0] == 1
    assert grant(9, 1, others, "me") == water_fill(9, 1, others, "me")
    # What the others hold still caps the grant.
    held = [("a", 12, 5, 0)]
    assert grant(13, 8, held, "me") == water_fill(13, 8, held, "me") == (1, 2, 0, 1)


def test_heads_are_dealt_whole_where_an_equal_split_would_start_none() -> None:
    """Six holders of a 16,384-token pool, each wanting 11,000 and naming a head of 3,700:
    the equal split (2,730 each) holds no head. Dealt whole by deadline, the four due
    first get theirs; the rest is water-filled over what each wants beyond."""
    names = ["a", "b", "c", "d", "e", "f"]
    heads = {name: (3700, 10.0 + k) for k, name in enumerate(names)}
    entitled = {}
    for me in names:
        others = [(o, 0, 11_000, 0) for o in names if o != me]
        entitled[me] = grant(16_384, 11_000, others, me, 0, 0, heads)[0]
        assert grant(16_384, 11_000, others, me)[0] in (2730, 2731)  # no heads: the split
    assert [entitled[n] >= 3700 for n in names] == [True] * 4 + [False] * 2
    assert sum(entitled.values()) <= 16_384
    # Heads come first, then the split: beside a holder using 900 of 1,000, a newcomer's
    # head of 300 is dealt and the rest split (350 each); the incumbent admits nothing
    # new until it is back within 350, and the newcomer grows into what it frees.
    heads_b = {"b": (300, 5.0)}
    assert grant(1000, 1000, [("b", 0, 1000, 0)], "a", 900, 900, heads_b)[0] == 350
    assert grant(1000, 1000, [("a", 900, 1000, 900)], "b", 0, 0, heads_b)[0] == 100
    assert grant(1000, 1000, [("a", 350, 1000, 350)], "b", 0, 0, heads_b)[0] == 650
    # A head no holder record stands behind (its process is gone) is no one's.
    others = [(o, 0, 11_000, 0) for o in names[1:]]
    assert grant(16_384, 11_000, others, "a", 0, 0, {"gone": (3700, 0.0)})[0] in (2730, 2731)


_holder = st.tuples(
    st.integers(0, 40),  # want
    st.integers(0, 12),  # used
    st.integers(0, 20),  # head (0: none)
    st.sampled_from([1.0, 2.0, 3.0, float("inf")]),  # its deadline
)


@settings(max_examples=400, deadline=None)
@given(total=st.integers(0, 80), holders=st.lists(_holder, min_size=1, max_size=6))
def test_with_heads_the_entitlements_sum_within_the_total(
    total: int, holders: list[tuple[int, int, int, float]]
) -> None:
    """Each holder's entitlement by heads, computed at its own renewal from the same
    records: together they never pass the total, and the head due first is held whole
    where it fits the total."""
    names = [f"h{k}" for k in range(len(holders))]
    wants = [(max(w, u), 0, n) for n, (w, u, _, _) in zip(names, holders, strict=True)]
    heads = {n: (h, due) for n, (_, _, h, due) in zip(names, holders, strict=True) if h}
    got = [_heads_first(total, wants, n, heads) for n in names]
    if not any(0 < h <= total for h, _ in heads.values()):
        assert got == [None] * len(names)
        return
    entitled = [e for e in got if e is not None]
    assert len(entitled) == len(names)
    assert sum(entitled) <= total
    first = min(heads, key=lambda n: (heads[n][1], n))
    if heads[first][0] <= total:
        assert entitled[names.index(first)] >= heads[first][0]
