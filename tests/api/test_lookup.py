"""``POST /v1/lookup`` against chunks stored directly through the store and fingerprint index."""

from __future__ import annotations

import httpx
import msgspec
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvblend.api import lookup as lookups
from kvblend.api.lookup import LookupBody
from kvblend.api.schemas import LookupRequest, LookupResponse
from kvblend.shm.errors import Busy
from kvblend.shm.matches import Match
from kvblend.shm.hashing import Namespace
from kvblend.shm.header import ORIGIN_FINAL
from kvblend.shm.lookup import covered_tokens
from tests.api.conftest import CHUNK, TOKEN, Cache, problem

NS = Namespace("model-a", 1)


def doc(seed: int, n_chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n_chunks * CHUNK, dtype=np.uint32)


def prompt_with(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.uint32)


@pytest.fixture
def stored(cache: Cache) -> tuple[np.ndarray, np.ndarray, list[bytes], list[bytes]]:
    a, b = doc(1, 3), doc(2, 2)
    return a, b, cache.put(NS, a), cache.put(NS, b)


def expected(a_at: int, b_at: int, ka: list[bytes], kb: list[bytes]) -> list[dict]:
    out = [dict(old_st=i * CHUNK, old_ed=(i + 1) * CHUNK, cur_st=a_at + i * CHUNK,
                cur_ed=a_at + (i + 1) * CHUNK, chunk_hash=k.hex(), origin="unknown", location="local")
           for i, k in enumerate(ka)]
    out += [dict(old_st=i * CHUNK, old_ed=(i + 1) * CHUNK, cur_st=b_at + i * CHUNK,
                 cur_ed=b_at + (i + 1) * CHUNK, chunk_hash=k.hex(), origin="unknown", location="local")
            for i, k in enumerate(kb)]
    return out


def test_json_finds_documents_at_unaligned_offsets(client: TestClient, cache: Cache,
                                                   stored: tuple) -> None:
    a, b, ka, kb = stored
    q = prompt_with(np.arange(5), b, np.arange(100, 107), a, np.arange(3))
    r = client.post("/v1/lookup", json={"model_name": "model-a", "world_size": 1,
                                        "token_ids": q.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    a_at, b_at = 5 + len(b) + 7, 5
    assert body["matches"] == sorted(expected(a_at, b_at, ka, kb), key=lambda m: m["cur_st"])
    assert body["hit_tokens"] == len(a) + len(b)
    assert body["requested_tokens"] == len(q) // CHUNK * CHUNK
    assert cache.store.stats().num_pinned == 0  # a lookup pins nothing


def test_binary_body_gives_the_same_answer(client: TestClient, stored: tuple) -> None:
    a, b, ka, kb = stored
    q = prompt_with(np.arange(9), a, b)
    as_json = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": q.tolist()})
    as_bytes = client.post("/v1/lookup", content=q.astype("<u4").tobytes(),
                           params={"model_name": "model-a", "world_size": 1},
                           headers={"content-type": "application/octet-stream"})
    assert as_bytes.status_code == 200, as_bytes.text
    assert as_bytes.json() == as_json.json()
    assert as_bytes.json()["hit_tokens"] == len(a) + len(b)


def test_other_namespaces_and_salts_see_nothing(client: TestClient, stored: tuple) -> None:
    a = stored[0]
    for body in ({"model_name": "model-b"}, {"model_name": "model-a", "world_size": 2},
                 {"model_name": "model-a", "cache_salt": "tenant-2"}):
        r = client.post("/v1/lookup", json={**body, "token_ids": a.tolist()})
        assert r.status_code == 200
        assert r.json()["matches"] == [] and r.json()["hit_tokens"] == 0


def test_evicted_chunks_are_not_reported(client: TestClient, cache: Cache, stored: tuple) -> None:
    a = stored[0]
    cache.store.clear()
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": a.tolist()})
    assert r.json() == {"matches": [], "hit_tokens": 0, "requested_tokens": len(a)}


def test_tensor_parallel_chunks_need_every_rank(client: TestClient, cache: Cache) -> None:
    ns2 = Namespace("model-a", 2)
    a = doc(3, 2)
    cache.put(ns2, a)
    r = client.post("/v1/lookup", json={"model_name": "model-a", "world_size": 2,
                                        "token_ids": a.tolist()})
    assert r.json()["hit_tokens"] == len(a)


@pytest.mark.parametrize("missing_rank", [0, 1])
def test_tensor_parallel_chunk_missing_one_rank_is_not_reported(client: TestClient, cache: Cache,
                                                                missing_rank: int) -> None:
    ns2 = Namespace("model-a", 2)
    a = doc(4, 3)
    keys = cache.put(ns2, a, missing={(1, missing_rank)})  # chunk 1 lacks one rank's shard
    r = client.post("/v1/lookup", json={"model_name": "model-a", "world_size": 2,
                                        "token_ids": a.tolist()})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [m["chunk_hash"] for m in got["matches"]] == [keys[0].hex(), keys[2].hex()]
    assert got["hit_tokens"] == 2 * CHUNK


def test_short_and_empty_prompts(client: TestClient, stored: tuple) -> None:
    for tokens in ([], [1, 2, 3]):
        r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": tokens})
        assert r.json() == {"matches": [], "hit_tokens": 0, "requested_tokens": 0}


@pytest.mark.parametrize("token_ids", [[1, -1, 2], [2**32], [1, 2**32 + 5], [1.5], ["7"], None])
def test_bad_json_token_ids_are_422(client: TestClient, token_ids: object) -> None:
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": token_ids})
    body = problem(r, 422)
    assert body["errors"] and body["errors"][0]["loc"][0] == "token_ids"


@pytest.mark.parametrize("body,params,detail", [
    (b"\x01\x00\x00", {"model_name": "m"}, "multiple of 4"),
    ((2**32 - 1).to_bytes(4, "little") + b"\x00" * 5, {"model_name": "m"}, "multiple of 4"),
    (b"\x01\x00\x00\x00", {}, "model_name"),
])
def test_bad_binary_bodies_are_422(client: TestClient, body: bytes, params: dict,
                                   detail: str) -> None:
    r = client.post("/v1/lookup", content=body, params=params,
                    headers={"content-type": "application/octet-stream"})
    assert detail in problem(r, 422)["detail"]


def test_binary_bad_query_parameter_is_422(client: TestClient) -> None:
    r = client.post("/v1/lookup", content=b"\x00" * 8, params={"model_name": "m", "world_size": 0},
                    headers={"content-type": "application/octet-stream"})
    problem(r, 422)


def test_malformed_json_and_missing_fields_are_422(client: TestClient) -> None:
    problem(client.post("/v1/lookup", content=b"{not json",
                        headers={"content-type": "application/json"}), 422)
    problem(client.post("/v1/lookup", json={"token_ids": [1]}), 422)
    problem(client.post("/v1/lookup", json={"model_name": "m", "token_ids": [1], "x": 1}), 422)


def test_other_content_types_are_415(client: TestClient) -> None:
    r = client.post("/v1/lookup", content=b"1 2 3", headers={"content-type": "text/plain"})
    assert problem(r, 415)["code"] == "unsupported_media_type"


def test_responses_follow_the_documented_model(client: TestClient, stored: tuple) -> None:
    a = stored[0]
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": a.tolist()})
    assert r.headers["content-type"] == "application/json"
    assert LookupResponse.model_validate(r.json()).hit_tokens == len(a)


def test_wire_decoder_matches_the_documented_request() -> None:
    """The msgspec twin used for speed takes exactly the fields and bounds of LookupRequest."""
    doc = LookupRequest.model_json_schema()
    assert {f.name for f in msgspec.structs.fields(LookupBody)} == set(doc["properties"])
    assert {f.name for f in msgspec.structs.fields(LookupBody) if f.required} == set(
        doc["required"])
    for f in msgspec.structs.fields(LookupBody):
        if not f.required:
            assert doc["properties"][f.name]["default"] == f.default
    wire = msgspec.json.schema(LookupBody)["$defs"]["LookupBody"]["properties"]
    assert wire["token_ids"]["items"] == {"type": "integer", "minimum": 0,
                                          "maximum": 2**32 - 1}
    assert doc["properties"]["token_ids"]["items"] == {"type": "integer", "minimum": 0,
                                                       "maximum": 2**32 - 1}
    for name in ("model_name", "cache_salt"):
        for bound in ("minLength", "maxLength"):
            assert wire[name].get(bound) == doc["properties"][name].get(bound)
    for bound in ("minimum", "maximum"):
        assert wire["world_size"][bound] == doc["properties"]["world_size"][bound]


# -- the fast path in front of the framework (api.lookup.LookupFastPath) --------------------------


def binary(client: TestClient, q: np.ndarray, **params: object) -> object:
    return client.post("/v1/lookup", content=q.astype("<u4").tobytes(),
                       params={"model_name": "model-a", **params},
                       headers={"content-type": "application/octet-stream"})


def test_well_formed_lookups_skip_the_route(client: TestClient, stored: tuple,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON and binary lookups are answered in front of the framework: the route never runs."""
    def not_here(*args: object) -> None:
        raise AssertionError("the route served a lookup the fast path should have taken")

    monkeypatch.setattr(lookups, "read_query", not_here)
    a = stored[0]
    assert binary(client, a).json()["hit_tokens"] == len(a)
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": a.tolist()})
    assert r.json()["hit_tokens"] == len(a)
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("how", [
    {"headers": {"content-type": "application/vnd.kvblend+json"}},   # a content type it leaves
    {"params": {"world_size": "01"}},                                # a number it does not parse
    {"params": {"model_name": ["x", "model-a"]}},                    # a repeated parameter
])
def test_requests_the_fast_path_leaves_get_the_same_answer(client: TestClient, stored: tuple,
                                                           how: dict) -> None:
    a, b, _, _ = stored
    q = prompt_with(np.arange(9), a, b)
    body = {"model_name": "model-a", "token_ids": q.tolist()}
    fast = client.post("/v1/lookup", json=body)
    params = {"model_name": "model-a", **how.get("params", {})}
    if "content-type" in how.get("headers", {}):
        slow = client.post("/v1/lookup", content=msgspec.json.encode(body), headers=how["headers"])
    else:
        slow = client.post("/v1/lookup", content=q.astype("<u4").tobytes(), params=params,
                           headers={"content-type": "application/octet-stream"})
    assert slow.status_code == 200, slow.text
    assert slow.json() == fast.json() and fast.json()["hit_tokens"] == len(a) + len(b)


def test_fast_path_and_route_take_only_the_exact_bearer_form(auth_client: TestClient) -> None:
    """``Bearer <token>`` exactly, once: the fast path serves it, and neither the fast path nor
    the route behind it admits any other spelling (tests/api/test_auth.py has the full list)."""
    body = {"model_name": "m", "token_ids": [1, 2, 3]}
    ok = auth_client.post("/v1/lookup", headers={"authorization": f"Bearer {TOKEN}"}, json=body)
    assert ok.status_code == 200, ok.text
    for headers in ([("authorization", f"bearer {TOKEN}")],
                    [("authorization", f"Bearer {TOKEN} ")],
                    [("authorization", f"Bearer {TOKEN}")] * 2):
        problem(auth_client.post("/v1/lookup", headers=headers, json=body), 401)


def test_query_parameters_are_checked_for_json_bodies_too(client: TestClient) -> None:
    r = client.post("/v1/lookup", params={"world_size": 0},
                    json={"model_name": "m", "token_ids": [1, 2, 3]})
    assert problem(r, 422)["code"] == "invalid_request"


def test_store_errors_in_the_fast_path_are_problems(client: TestClient,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def busy(*args: object) -> None:
        raise Busy("the fingerprint index stayed locked")

    monkeypatch.setattr(lookups, "lookup", busy)
    r = binary(client, np.arange(3, dtype=np.uint32))
    body = problem(r, 503)
    assert body["code"] == "busy" and body["instance"] == "/v1/lookup"


def test_covered_tokens_counts_overlaps_once() -> None:
    m = [Match(0, 16, 0, 16, b"a" * 16), Match(0, 16, 8, 24, b"b" * 16),
         Match(0, 16, 40, 56, b"c" * 16)]
    assert covered_tokens(m) == 24 + 16
    assert covered_tokens([]) == 0


# -- model names and salts that shm.hashing refuses ---------------------------------------------

BAD_LABELS = [
    pytest.param("model_name", "\u0000", id="name-nul"),
    pytest.param("model_name", "model\u0000a", id="name-inner-nul"),
    pytest.param("model_name", "\x1b[2J", id="name-escape-sequence"),
    pytest.param("model_name", "\u2028", id="name-line-separator"),
    pytest.param("model_name", "\u00e9" * 61, id="name-122-bytes-in-61-chars"),
    pytest.param("cache_salt", "\u0000", id="salt-nul"),
    pytest.param("cache_salt", "\x07", id="salt-bell"),
    pytest.param("cache_salt", "\u00e9" * 129, id="salt-258-bytes-in-129-chars"),
]


def bad_lookup(client: TestClient, field: str, value: str, binary: bool) -> httpx.Response:
    """A lookup the fast path would serve but for ``field``'s value."""
    fields = {"model_name": "model-a", field: value}
    headers = {"authorization": f"Bearer {TOKEN}"}
    if binary:
        return client.post("/v1/lookup", params=fields, content=b"\x01\x00\x00\x00" * 4,
                           headers={**headers, "content-type": "application/octet-stream"})
    return client.post("/v1/lookup", json={**fields, "token_ids": [1, 2, 3, 4]}, headers=headers)


def still_serves(client: TestClient, a: np.ndarray) -> None:
    """Status, metrics, events and a good lookup all answer as if nothing had happened."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert client.get("/v1/status", headers=headers).status_code == 200
    assert client.get("/metrics", headers=headers).status_code == 200
    events = client.get("/v1/events", headers=headers)
    assert events.status_code == 200 and events.json()["events"] == []  # the refused left none
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": a.tolist()},
                    headers=headers)
    assert r.status_code == 200 and r.json()["hit_tokens"] == len(a)
    r = client.post("/v1/lookup", content=a.astype("<u4").tobytes(),
                    params={"model_name": "model-a"},
                    headers={**headers, "content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["hit_tokens"] == len(a)


@pytest.mark.parametrize("binary_body", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("field,value", BAD_LABELS)
def test_refused_names_and_salts_are_422_and_harm_nothing(auth_client: TestClient, stored: tuple,
                                                         field: str, value: str,
                                                         binary_body: bool) -> None:
    for _ in range(2):  # the same bad request again answers the same
        body = problem(bad_lookup(auth_client, field, value, binary_body), 422)
        assert body["code"] == "invalid_input" and field in body["detail"]
    still_serves(auth_client, stored[0])


def test_matches_say_where_and_how_their_kv_was_computed(client: TestClient,
                                                         cache: Cache) -> None:
    a, f = doc(5, 3), doc(6, 2)
    ka = cache.put(NS, a, first_position=1)                      # behind a BOS token
    kf = cache.put(NS, f, first_position=40, origin=ORIGIN_FINAL)  # inside a longer prompt
    q = prompt_with(np.arange(3), f, a)

    def ask(**extra: object) -> dict:
        r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": q.tolist(),
                                            **extra})
        assert r.status_code == 200, r.text
        return r.json()

    got = ask()["matches"]
    assert [(m["chunk_hash"], m["origin"], m["old_st"], m["old_ed"]) for m in got] == (
        [(k.hex(), "final", 40 + i * CHUNK, 40 + (i + 1) * CHUNK) for i, k in enumerate(kf)]
        + [(k.hex(), "pre_computed", 1 + i * CHUNK, 1 + (i + 1) * CHUNK)
           for i, k in enumerate(ka)])
    only = ask(standalone_only=True)
    assert [m["chunk_hash"] for m in only["matches"]] == [k.hex() for k in ka]
    assert only["hit_tokens"] == len(a)
    for value in ("true", "1", "yes"):  # the fast path takes "true"; the route the others
        r = client.post("/v1/lookup", content=q.astype("<u4").tobytes(),
                        params={"model_name": "model-a", "standalone_only": value},
                        headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200 and r.json() == only, (value, r.text)
    r = client.post("/v1/lookup", content=q.astype("<u4").tobytes(),
                    params={"model_name": "model-a", "standalone_only": "maybe"},
                    headers={"content-type": "application/octet-stream"})
    assert problem(r, 422)["errors"][0]["loc"][-1] == "standalone_only"
    assert ask()["matches"] == got  # leaving chunks out of one answer dropped nothing
