"""The order word's counts (``dataplane.streamword``): which of two 32-bit counts comes later, as
the data plane keeps the highest count named to release the word, across the wrap."""

from __future__ import annotations

from kvblend.dataplane import streamword


def test_later_counts_across_the_wrap() -> None:
    top = streamword.MASK
    assert streamword.later(1, 0) and not streamword.later(0, 1)
    assert not streamword.later(5, 5)
    assert streamword.later(0, top) and streamword.later(3, top - 2)  # wrapped: still later
    assert not streamword.later(top, 0)
    assert streamword.later((1 << 31) - 1, 0) and not streamword.later(0, (1 << 31) - 1)
