"""What the channel says when it cannot connect: no data plane at the address, or a socket that
refuses this process's uid (the uid rule of docs/security.md), each with its own cause and fix."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvblend.dataplane.channel import Channel
from kvblend.dataplane.errors import DataPlaneUnavailable
from kvblend.dataplane.messages import Ping
from tests.dataplane.test_trust import NOBODY, as_user


@pytest.fixture
def listening(shm_prefix: str) -> Iterator[str]:
    """A listening Unix socket where the data plane's would be, mode 0600 as the data plane
    makes it (nothing answers: the kernel refuses another uid's connect before any byte)."""
    path = f"/dev/shm/{shm_prefix}_dataplane.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(1)
        try:
            yield path
        finally:
            os.unlink(path)


def refusal(address: str) -> str:
    """The channel's error on connecting to ``address``."""
    with Channel(address, connect_timeout=30) as channel, \
            pytest.raises(DataPlaneUnavailable) as refused:
        channel.call(Ping(), timeout=30)
    return str(refused.value)


def test_no_data_plane_says_so(shm_prefix: str) -> None:
    said = refusal(f"/dev/shm/{shm_prefix}_dataplane.sock")
    assert said.startswith("no data plane at ") and "No such file" in said


def test_a_socket_that_refuses_this_uid_names_the_uid_rule(listening: str) -> None:
    """An engine under another uid than the service's: EACCES on connect. As root the test
    drops to nobody in a forked child (root passes any mode bits); as anyone else, the socket's
    mode bits refuse its own owner."""
    if os.geteuid() == 0:
        said = as_user(NOBODY, lambda: refusal(listening).encode()).decode()
        me, owner = NOBODY, 0
    else:
        os.chmod(listening, 0)
        said = refusal(listening)
        me = owner = os.geteuid()
    assert "no data plane" not in said, said
    assert f"{listening} refuses this process (uid {me})" in said
    assert f"belongs to uid {owner}, the uid that runs kvblend serve" in said
    assert "docs/security.md" in said
