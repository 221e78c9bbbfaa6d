"""`admission.lease.grant` against the water-filling it shortens: where every want fits it
skips the sort (each holder is entitled to its want, and the rest is split equally);
everywhere its results must be those of the full algorithm, kept here as written."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from admission.lease import grant


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
