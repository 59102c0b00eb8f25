"""Problem titles (``api.errors.TITLES``): the same on every Python, from one table.

``http.HTTPStatus`` renamed four phrases to RFC 9110's in Python 3.13; a title read from it would
differ between 3.11/3.12 and 3.13 (README's error sample did). The app's own answers are checked
here; README's sample against a live service in ``tests/test_readme.py``.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from kvblend.api.errors import ERROR_STATUS, TITLES, documented, problem_response
from tests.api.apps import serving
from tests.api.conftest import Cache, problem

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
        body = json.loads(bytes(problem_response(status, "d", "/p", "Code").body))
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
    assert json.loads(bytes(problem_response(499, "d", "/p", "Code").body))["title"] == "Error"
