"""Matches on the wire: the client packs them as int64 rows (``match_bytes``), the data plane
reads and checks them as one array (``match_rows``). Every row is hostile until checked: torn
rows, negative or huge positions (whose differences would overflow int64), spans other than one
chunk, and matches past the prompt or the buffer are refused before any side effect."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblend.dataplane.calls import MATCH_FIELDS, match_rows
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.client_transfer import match_bytes
from kvblend.dataplane.errors import BadRequest, OutOfRange
from kvblend.dataplane.messages import RetrieveChunks
from kvblend.shm.matches import Match
from tests.dataplane.conftest import CHUNK, DataPlaneProc

C = 4


def rows(*fields: tuple[int, int, int, int]) -> bytes:
    """Rows written directly (hash words 0), as a hostile client would."""
    return np.array([(*f, 0, 0) for f in fields], "<i8").tobytes()


def test_packed_matches_read_back_field_by_field() -> None:
    rng = np.random.default_rng(0)
    ms = [Match(8 * j, 8 * j + C, 4 * j, 4 * j + C, rng.bytes(16)) for j in range(5)]
    m = match_rows(match_bytes(ms), 4 * 5, C)
    assert m.shape == (5, 6)
    for j, x in enumerate(ms):
        assert m[j, :4].tolist() == [x.old_st, x.old_ed, x.cur_st, x.cur_ed]
        assert m[j, 4:].astype("<i8").tobytes() == x.chunk_hash
    assert match_rows(match_bytes([]), 0, C).shape == (0, 6)


def test_the_client_refuses_hashes_of_another_length_and_positions_past_int64() -> None:
    with pytest.raises(BadRequest, match="match 1 has a chunk_hash of 15 bytes"):
        match_bytes([Match(0, C, 0, C, b"h" * 16), Match(0, C, 0, C, b"h" * 15)])
    with pytest.raises(BadRequest, match="not four int64 positions"):
        match_bytes([Match(0, C, 2**64, 2**64 + C, b"h" * 16)])


@pytest.mark.parametrize("raw, error, message", [
    (rows((0, C, 0, C))[:-1], BadRequest, "rows of 48 bytes"),
    (rows((0, C, 0, C), (-C, 0, 0, C)), BadRequest, "match 1 does not span"),
    (rows((0, C, 0, C + 1)), BadRequest, "match 0 does not span"),
    (rows((0, C - 1, 0, C)), BadRequest, "match 0 does not span"),
    # differences that wrap around int64 to exactly C: refused by the bound, not by the span
    (rows((2**63 - 2, -(2**63) + C - 2, 0, C)), BadRequest, "match 0 does not span"),
    (rows((MATCH_FIELDS, MATCH_FIELDS + C, 0, C)), BadRequest, "match 0 does not span"),
    (rows((0, C, 8, 8 + C)), OutOfRange, "match 0 ends at 12, past the 8 prompt tokens"),
], ids=["torn", "negative", "long", "short", "wrapping", "huge", "past the prompt"])
def test_hostile_rows_are_refused(raw: bytes, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        match_rows(raw, 8, C)


def test_a_match_past_the_buffer_is_refused_even_where_the_offset_would_overflow() -> None:
    raw = rows((0, C, 0, C), (0, C, C, 2 * C))
    assert match_rows(raw, 2 * C, C, 0, 2 * C).shape == (2, 6)  # inside
    with pytest.raises(OutOfRange, match="match 1 at offset 1 "):
        match_rows(raw, 2 * C, C, 1, 2 * C)
    with pytest.raises(OutOfRange, match="match 0 at offset"):  # offset + cur_ed wraps int64
        match_rows(raw, 2 * C, C, 2**63 - 2, 2 * C)


@pytest.mark.slow
def test_the_data_plane_refuses_torn_rows_and_serves_packed_ones(
        dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(1).integers(0, 50_000, 2 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(2, 2 * CHUNK, 8, torch.float16)
        inst = client.register_kv_cache(kv, model_name="rows")
        assert client.store_pre_computed(inst, doc).wait(60).ok
        matches = client.lookup(doc, "rows").matches
        base = dict(instance_id=inst, token_ids=doc.astype("<u4").tobytes(),
                    token=client._token(inst))
        with Channel(dataplane.address) as ch:
            with pytest.raises(BadRequest, match="rows of 48 bytes"):
                ch.call(RetrieveChunks(**base, matches=match_bytes(matches)[:-8]), 60)
            with pytest.raises(OutOfRange, match="exceeds the buffer's"):
                ch.call(RetrieveChunks(**base, matches=match_bytes(matches), offset=CHUNK), 60)
        done = client.retrieve(inst, doc, matches).wait(60)
        assert done.ok and done.copied == 2


def specification(rows: list[tuple[int, int, int, int]], n_tokens: int, C: int, offset: int,
                  T: int) -> tuple[type, int] | None:
    """What ``match_rows`` must answer, in Python's unbounded integers: the first refused row
    and its error, or None."""
    for j, (old_st, old_ed, cur_st, cur_ed) in enumerate(rows):
        if any(not 0 <= x < MATCH_FIELDS for x in (old_st, old_ed, cur_st, cur_ed)):
            return BadRequest, j
        if old_ed - old_st != C or cur_ed - cur_st != C:
            return BadRequest, j
        if cur_ed > n_tokens:
            return OutOfRange, j
        if offset + cur_ed > T:
            return OutOfRange, j
    return None


edges = st.sampled_from([0, 1, C, 2 * C, 7, MATCH_FIELDS - C, MATCH_FIELDS - 1, MATCH_FIELDS,
                         2**63 - 1, -1, -(2**63), -(2**63) + C])
position = st.one_of(st.integers(0, 4 * C), edges)
start = st.one_of(st.integers(0, 4 * C), st.sampled_from(  # a chunk from here fits int64
    [MATCH_FIELDS - C, MATCH_FIELDS - C + 1, MATCH_FIELDS, -C, -(2**63)]))


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.one_of(
    st.tuples(position, position, position, position),
    st.builds(lambda o, c: (o, o + C, c, c + C), start, start)),
    max_size=6),
    n_tokens=st.integers(0, 4 * C), offset=st.one_of(st.integers(0, 4 * C), edges),
    T=st.integers(0, 6 * C))
def test_the_compiled_checks_answer_as_the_specification(
        rows: list[tuple[int, int, int, int]], n_tokens: int, offset: int, T: int) -> None:
    raw = np.array([(*r, 0, 0) for r in rows], "<i8").reshape(-1, 6).tobytes()
    want = specification(rows, n_tokens, C, offset, T)
    if want is None:
        m = match_rows(raw, n_tokens, C, offset, T)
        assert m[:, :4].tolist() == [list(r) for r in rows]
    else:
        error, j = want
        with pytest.raises(BadRequest, match=f"^match {j} ") as got:
            match_rows(raw, n_tokens, C, offset, T)
        assert got.type is error  # OutOfRange is a BadRequest: the exact kind
