"""Slow and partial HTTP connections against a real ``kvblend serve`` (``api.connections``): they
are closed within the head timeout (a slow body too), at most ``--http-max-connections`` stay
open, a head past ``MAX_HEAD_BYTES`` is closed at once, and ``/healthz`` on a fresh connection is
answered all along."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from kvblend.api.connections import MAX_HEAD_BYTES
from tests.harness import HOST, Services, poll

pytestmark = pytest.mark.slow

PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: kvblend\r\nX-Slow: "
WHOLE_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: kvblend\r\n\r\n"
#: a whole head, then 8 of the 4096 bytes of body it announces
SLOW_BODY = (b"POST /v1/lookup?model_name=m HTTP/1.1\r\nHost: kvblend\r\n"
             b"Content-Type: application/octet-stream\r\nContent-Length: 4096\r\n\r\n" + b"\0" * 8)
#: generous: the bounds under test are a few seconds; a deadline only ends a failing test
DEADLINE = 60.0


def connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=10.0)
    if send:
        sock.sendall(send)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (an end of file or a reset, after any answer)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def healthz(port: int) -> int:
    """``/healthz`` on a connection of its own."""
    return httpx.get(f"http://{HOST}:{port}/healthz", timeout=10.0).status_code


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def test_partial_and_idle_connections_are_closed_within_the_head_timeout(
        services: Services, sockets: list[socket.socket]) -> None:
    svc = services.start("--http-head-timeout-s", "2", "--http-keep-alive-s", "1")
    sockets += [connect(svc.port, PARTIAL_HEAD) for _ in range(60)]
    sockets += [connect(svc.port) for _ in range(20)]                # nothing sent at all
    answered = connect(svc.port, WHOLE_REQUEST)                      # then idle
    half_again = connect(svc.port, WHOLE_REQUEST)
    poll(lambda: half_again.recv(65536), DEADLINE, "the first answer")
    half_again.sendall(PARTIAL_HEAD)                                 # a second head, half sent
    sockets += [answered, half_again]
    assert healthz(svc.port) == 200
    poll(lambda: all(closed_by_server(s) for s in sockets), DEADLINE,
         "the server to close every slow connection")
    assert healthz(svc.port) == 200


def test_at_most_max_connections_wait_and_a_new_one_is_answered(
        services: Services, sockets: list[socket.socket]) -> None:
    # a head timeout far beyond the deadline: only the bound on their number closes them
    svc = services.start("--http-head-timeout-s", "300", "--http-max-connections", "16")
    for _ in range(3):
        sockets += [connect(svc.port, PARTIAL_HEAD) for _ in range(40)]
        assert healthz(svc.port) == 200
        poll(lambda: sum(not closed_by_server(s) for s in sockets) <= 16, DEADLINE,
             "at most 16 connections open")
    assert not all(closed_by_server(s) for s in sockets[-8:])  # the newest ones wait on

    big = connect(svc.port)  # the newest, so the bound on the number spares it
    sockets.append(big)
    try:
        big.sendall(PARTIAL_HEAD + b"x" * MAX_HEAD_BYTES)
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while it still sent
    poll(lambda: closed_by_server(big), DEADLINE, f"a head over {MAX_HEAD_BYTES} bytes closed")


def test_slow_bodies_are_closed_and_a_new_connection_is_answered(
        services: Services, sockets: list[socket.socket]) -> None:
    svc = services.start("--http-head-timeout-s", "2", "--http-max-connections", "16")
    # the reproduction: whole heads, then a body that never ends; such connections were in a
    # request for ever, so past the bound every new connection was the one closed
    sockets += [connect(svc.port, SLOW_BODY) for _ in range(40)]
    poll(lambda: sum(not closed_by_server(s) for s in sockets) <= 16, DEADLINE,
         "at most 16 connections open")
    assert healthz(svc.port) == 200
    poll(lambda: all(closed_by_server(s) for s in sockets), DEADLINE,
         "the server to close every slow body")
    assert healthz(svc.port) == 200
