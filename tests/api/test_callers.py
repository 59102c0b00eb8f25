"""Who an HTTP registration is for (``api.callers``): a token where the service has tokens, else
the uid at the other end of a loopback connection (real sockets, the kernel's own table), else
the peer's address."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvblend.api.app import create_app
from kvblend.api.callers import caller_of, loopback_uid
from tests.api.apps import ADMIN, bearer
from tests.api.conftest import TOKEN, make_settings


@pytest.fixture
def pair() -> Iterator[tuple[tuple[str, int], tuple[str, int]]]:
    """A connected loopback TCP pair: (the client's address, the server's)."""
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()[:2]) as client:
        accepted, _ = server.accept()
        with accepted:
            yield client.getsockname()[:2], server.getsockname()[:2]


def test_a_loopback_peer_is_the_uid_that_owns_its_socket(
        pair: tuple[tuple[str, int], tuple[str, int]]) -> None:
    client, server = pair
    assert loopback_uid(client, server) == os.getuid()
    assert loopback_uid(server, client) == os.getuid()  # the other end: this process too


def test_a_peer_the_table_does_not_hold_has_no_uid(
        pair: tuple[tuple[str, int], tuple[str, int]]) -> None:
    client, server = pair
    assert loopback_uid(client, (server[0], server[1] ^ 1)) is None  # no such connection
    assert loopback_uid(("192.0.2.7", client[1]), server) is None    # not loopback
    assert loopback_uid(("testclient", 50000), server) is None       # not an address


def scope(shm_prefix: str, headers: list[tuple[bytes, bytes]], **settings: object) -> dict:
    app = create_app(make_settings(shm_prefix, **settings))  # its tokens; no lifespan needed
    return {"type": "http", "app": app, "headers": headers, "client": ("192.0.2.7", 4000),
            "server": ("192.0.2.1", 8000)}


def header(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", bearer(token)["authorization"].encode())]


def test_each_token_is_a_caller_and_is_not_sent(shm_prefix: str) -> None:
    tokens = {"api_token": TOKEN, "admin_token": ADMIN}
    api = caller_of(scope(shm_prefix, header(TOKEN), **tokens))
    admin = caller_of(scope(shm_prefix, header(ADMIN), **tokens))
    assert api.startswith("token:") and admin.startswith("token:") and api != admin
    assert TOKEN not in api and ADMIN not in admin


@pytest.mark.parametrize("tokens", [{}, {"admin_token": ADMIN}])
def test_a_made_up_token_makes_no_new_caller(shm_prefix: str, tokens: dict) -> None:
    # no API token configured: any header is let in, so it must not name a caller of its own
    for made_up in ("a", "b"):
        assert caller_of(scope(shm_prefix, header(made_up), **tokens)) == "addr:192.0.2.7"
