"""Problem titles (``api.errors.TITLES``) and codes (``api.errors.ErrorCode``), each from one table.

``http.HTTPStatus`` renamed four phrases to RFC 9110's in Python 3.13; a title read from it would
differ between 3.11/3.12 and 3.13 (README's error sample did). The app's own answers are checked
here; README's sample against a live service in ``tests/test_readme.py``.

Codes are a documented list (docs/errors.md, the OpenAPI document), never a Python class name
(they were ``HTTPException``, ``DecodeError``, ``RequestValidationError``).
"""

from __future__ import annotations

import builtins
import json
import re
import sys
from http import HTTPStatus
from pathlib import Path

import pytest

from kvblend.api import errors
from kvblend.api.app import create_app
from kvblend.api.errors import (CODES, ERROR_CODE, ERROR_STATUS, HTTP_CODE, TITLES, ErrorCode,
                                code_of, codes_table, documented, problem_response)
from kvblend.api.settings import Settings
from kvblend.dataplane import errors as dataplane_errors
from kvblend.shm import errors as shm_errors
from tests.api.apps import ADMIN, bearer, serving
from tests.api.conftest import TOKEN, Cache, problem

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
SNAKE = re.compile(r"[a-z]+(?:_[a-z]+)*")

# What Python 3.11 and 3.12 say for the statuses RFC 9110 renamed (3.13 says what TITLES does).
BEFORE_RFC9110 = {413: "Request Entity Too Large", 414: "Request-URI Too Long",
                  416: "Requested Range Not Satisfiable", 422: "Unprocessable Entity"}
RFC9110 = {413: "Content Too Large", 414: "URI Too Long", 416: "Range Not Satisfiable",
           422: "Unprocessable Content"}


def test_every_error_status_python_knows_has_our_title() -> None:
    """No title falls through to this Python's phrases, and ours differ from them only where
    RFC 9110 renamed a status and this Python predates it."""
    for status in HTTPStatus:
        if status >= 400:
            assert status.phrase in {TITLES[status], BEFORE_RFC9110.get(status)}, status
    assert {s: TITLES[s] for s in RFC9110} == RFC9110


def test_every_status_the_api_answers_has_a_title() -> None:
    answered = {*ERROR_STATUS.values(), 404, 405, 500}  # the router's own, and the fallback
    assert answered <= TITLES.keys()


def test_titles_and_descriptions_come_from_the_table() -> None:
    for status, title in TITLES.items():
        body = json.loads(bytes(problem_response(status, "d", "/p", ErrorCode.HTTP_ERROR).body))
        assert body["title"] == title
        assert documented(status)["description"] == title


def test_the_app_answers_rfc9110_titles(shm_prefix: str, cache: Cache) -> None:
    with serving(shm_prefix, max_request_kb=64) as client:
        invalid = client.post("/v1/lookup", json={"model_name": "m", "token_ids": [1, -1]})
        assert problem(invalid, 422)["title"] == "Unprocessable Content"
        large = client.post("/v1/lookup", content=b"\0" * (64 * 1024 + 4),
                            headers={"content-type": "application/octet-stream"})
        assert problem(large, 413)["title"] == "Content Too Large"
        assert problem(client.get("/v1/nothing"), 404)["title"] == "Not Found"


def test_a_status_outside_the_table_still_gets_a_title() -> None:
    body = json.loads(bytes(problem_response(499, "d", "/p", ErrorCode.HTTP_ERROR).body))
    assert body["title"] == "Error"


# -- codes: one documented list ---------------------------------------------------------------


def class_names() -> set[str]:
    """Every exception class name a code could have leaked: ours, the frameworks', the builtins'."""
    names = {n for n, v in vars(builtins).items() if isinstance(v, type)}
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.split(".")[0] in (
                "kvblend", "fastapi", "starlette", "pydantic", "msgspec"):
            names |= {n for n, v in list(vars(module).items()) if isinstance(v, type)}
    return names


def test_every_code_the_tables_give_is_listed_and_none_is_a_class_name() -> None:
    assert ERROR_CODE.keys() == ERROR_STATUS.keys()
    emitted = {*ERROR_CODE.values(), *HTTP_CODE.values(), ErrorCode.HTTP_ERROR,
               ErrorCode.INVALID_REQUEST, code_of(RuntimeError("a bug"))}
    subclasses = [*_tree(errors.ApiError), *_tree(dataplane_errors.DataPlaneError),
                  *_tree(shm_errors.ShmError)]
    emitted |= {code_of(klass.__new__(klass)) for klass in subclasses}
    assert emitted == set(ErrorCode)  # no code listed that nothing emits, none emitted unlisted
    taken = class_names()
    for code in ErrorCode:
        assert SNAKE.fullmatch(code) and code not in taken, code


def test_a_data_plane_error_keeps_the_code_its_client_maps_back() -> None:
    for klass, code in dataplane_errors.PROBLEM_CODE.items():
        assert code_of(klass("why")) == code
        assert type(dataplane_errors.http_error(ERROR_STATUS[klass], code, "why")) is klass


def test_the_list_is_documented_in_the_docs_and_the_openapi_document() -> None:
    assert CODES.keys() == set(ErrorCode)
    table = codes_table()
    assert table in DOC.read_text(), "docs/errors.md: paste api.errors.codes_table() in again"
    schema = create_app(Settings()).openapi()
    assert schema["components"]["schemas"]["ErrorCode"]["enum"] == list(ErrorCode)
    assert table in schema["info"]["description"]


def _tree(root: type) -> list[type]:
    found = [root]
    for sub in root.__subclasses__():
        found += _tree(sub)
    return found


def test_the_app_answers_listed_codes_only(shm_prefix: str, cache: Cache) -> None:
    """Every kind of refusal the real app gives, through its lifespan: each code is listed."""
    with serving(shm_prefix, api_token=TOKEN, admin_token=ADMIN, max_request_kb=64) as client:

        @client.app.get("/test-bug")  # type: ignore[attr-defined]
        def bug() -> None:
            raise RuntimeError("a bug")

        auth = bearer(TOKEN)
        answers = {
            "unauthorized": client.get("/v1/status"),
            "admin_required": client.delete("/v1/chunks", headers=auth),
            "not_found": client.get("/v1/nothing", headers=auth),
            "method_not_allowed": client.put("/v1/status", headers=auth),
            "payload_too_large": client.post("/v1/lookup", headers=auth, content=b"0" * 65 * 1024),
            "unsupported_media_type": client.post("/v1/lookup", content=b"x", headers={
                **auth, "content-type": "text/plain"}),
            "invalid_request": client.get("/v1/events?limit=0", headers=auth),
            "invalid_input": client.post("/v1/instances", content=b"{}", headers={
                **auth, "content-type": "text/plain"}),
            "dataplane_unavailable": client.get("/v1/instances", headers=auth),
            "internal_error": client.get("/test-bug"),
        }
        answers["invalid_request (body)"] = client.post(
            "/v1/lookup", headers=auth, json={"model_name": "m", "token_ids": [1, -1]})
        answers["invalid_request (not JSON)"] = client.post(
            "/v1/lookup", headers={**auth, "content-type": "application/json"}, content=b"\xff")
    for want, r in answers.items():
        body = problem(r, r.status_code)
        assert body["code"] == want.split(" ")[0], (want, r.text)
        assert body["code"] in set(ErrorCode)
