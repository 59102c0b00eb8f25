"""Squatting kvblend's names before it starts, as the same uid and as a second Unix user.

``kvblend serve`` runs as a real process on a fresh prefix where a name was planted first; it must
exit 2 with one error line naming the path, and leave the planted name exactly as it was. The data
plane's ``_bind`` gets the same treatment for the socket path. As root, a second user
(``kvblend-test``) checks from outside that every name of a running store is closed to it.
Without ``--shm-prefix`` the service runs on its user's own prefix (``api.userprefix``), which a
planted name cannot stop: a name at the old predictable prefix is beside the point, and one
under the user's own prefix makes serve draw another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvblend.dataplane.server import _bind
from kvblend.shm.errors import ForeignObject
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.names import Names
from kvblend.shm.private import open_private
from kvblend.shm.store import Store

from .harness import Service, free_port, remove_prefix, serve_env
from .shm.storeutil import SMALL
from .squat import OtherUser, Squatter, foreign_uid, needs_root, other_user, snapshot

SERVE_DEADLINE = 120.0
STORE_NAMES = ("_meta", "_slab", "_fp", "_events", "_store.lock", "_fp.lock", "_events.lock",
               "_serve.lock")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A root-only file outside /dev/shm that a planted symlink points at."""
    target = tmp_path / "precious"
    target.write_bytes(b"do not touch")
    target.chmod(0o600)
    return target


def serve(prefix: str) -> subprocess.CompletedProcess[str]:
    """``kvblend serve`` on ``prefix`` with a tiny CPU store, run until it exits by itself."""
    env = serve_env()
    argv = [sys.executable, "-m", "kvblend.api.cli", "serve", "--storage-mb", "8", "--page-mb", "1",
            "--min-slot-kb", "4", "--backend", "cpu", "--shm-prefix", prefix,
            "--port", str(free_port()), "--fingerprint-capacity", "1024"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=SERVE_DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"kvblend serve did not stop by itself within {SERVE_DEADLINE} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def assert_refused(result: subprocess.CompletedProcess[str], path: str) -> None:
    """Exit code 2, one ERROR line that names ``path``, no traceback."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1 and path in errors[0], result.stderr
    assert [line for line in lines if path in line] == errors, result.stderr


# -- the same uid planted a name ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("suffix, how", [("_meta", "symlink"), ("_serve.lock", "mode 0666"),
                                         ("_dataplane.sock", "file"), ("_events", "mode 0666")])
def test_serve_refuses_a_planted_name(squat: Squatter, outside: Path, suffix: str,
                                      how: str) -> None:
    if how == "symlink":
        path = squat.symlink(suffix, str(outside))
    else:
        path = squat.file(suffix, mode=0o666 if how == "mode 0666" else 0o600)
    before = snapshot(path), snapshot(str(outside))
    assert_refused(serve(squat.prefix), path)
    assert (snapshot(path), snapshot(str(outside))) == before


# -- the data plane's socket -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["file", "symlink", "another uid"])
def test_bind_refuses_a_planted_socket_path(squat: Squatter, outside: Path, how: str) -> None:
    if how == "file":
        path = squat.file("_dataplane.sock")
    elif how == "symlink":
        path = squat.symlink("_dataplane.sock", str(outside))
    else:
        needs_root()
        path = squat.stale_socket("_dataplane.sock", uid=foreign_uid())
    before = snapshot(path), snapshot(str(outside))
    with pytest.raises(ForeignObject, match=path):
        _bind(path)
    assert (snapshot(path), snapshot(str(outside))) == before


def test_bind_replaces_a_stale_socket_of_ours(squat: Squatter) -> None:
    path = squat.stale_socket("_dataplane.sock")
    stale = os.lstat(path).st_ino
    listener = _bind(path)
    try:
        st = os.lstat(path)
        assert st.st_ino != stale and st.st_mode & 0o777 == 0o600
        with pytest.raises(OSError, match="already serves"):
            _bind(path)
    finally:
        listener.close()


# -- a second Unix user ------------------------------------------------------------------------

_TRY_EACH = """
import os, sys
for path in sys.argv[1:]:
    for what, flags in (("read", os.O_RDONLY), ("write", os.O_RDWR)):
        try:
            os.close(os.open(path, flags | os.O_NOFOLLOW))
            print("OPENED", what, path)
        except PermissionError:
            pass
    try:
        os.unlink(path)
        print("REMOVED", path)
    except PermissionError:
        pass
"""


@pytest.fixture
def stranger() -> OtherUser:
    return other_user()


@pytest.mark.slow
def test_another_user_cannot_open_or_remove_any_name(shm_prefix: str,
                                                     stranger: OtherUser) -> None:
    with Store.open(shm_prefix, SMALL), FingerprintIndex.open(shm_prefix, 16, 64), \
            EventLog.open(shm_prefix):
        os.close(open_private(Names(shm_prefix).lock("serve"), create=True))
        paths = [f"/dev/shm/{shm_prefix}{suffix}" for suffix in STORE_NAMES]
        assert all(os.path.exists(p) for p in paths)
        result = stranger.run(_TRY_EACH, *paths)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert all(os.path.exists(p) for p in paths)


_PLANT = """
import os, socket, sys
how, path, target = sys.argv[1:]
if how == "symlink":
    os.symlink(target, path)
elif how == "socket":
    socket.socket(socket.AF_UNIX).bind(path)
else:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, int(how, 8)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("suffix, how", [("_serve.lock", "0600"), ("_meta", "symlink"),
                                         ("_slab", "0666"), ("_dataplane.sock", "socket")])
def test_serve_refuses_a_name_another_user_planted(squat: Squatter, stranger: OtherUser,
                                                   outside: Path, suffix: str, how: str) -> None:
    path = squat.path(suffix)
    planted = stranger.run(_PLANT, how, path, str(outside))
    assert planted.returncode == 0, planted.stderr
    assert os.lstat(path).st_uid == stranger.uid
    before = snapshot(path), snapshot(str(outside))
    assert_refused(serve(squat.prefix), path)
    assert (snapshot(path), snapshot(str(outside))) == before


# -- the default prefix ------------------------------------------------------------------------

OLD_DEFAULT = "kvblend"  # the prefix every service without --shm-prefix used to share


def plant_foreign(path: str) -> str:
    """A file at ``path`` of another uid (as root), else one of ours with mode 0666: either is a
    name the service must not adopt."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.fchmod(fd, 0o666)
        if os.geteuid() == 0:
            os.fchown(fd, foreign_uid(), -1)
    finally:
        os.close(fd)
    return path


@pytest.fixture
def planted() -> Iterator[list[str]]:
    """Paths a test planted outside its own prefix, and prefixes a default serve drew: all
    removed afterwards."""
    paths: list[str] = []
    yield paths
    for path in paths:
        if path.startswith("prefix:"):
            remove_prefix(path.removeprefix("prefix:"))
        elif os.path.lexists(path):
            os.unlink(path)


@pytest.mark.slow
def test_a_planted_name_cannot_stop_the_default_prefix(tmp_path: Path,
                                                        planted: list[str]) -> None:
    old = f"/dev/shm/{OLD_DEFAULT}_serve.lock"
    if not os.path.lexists(old):  # another user's name at the old, predictable prefix
        planted.append(plant_foreign(old))
    env = {"XDG_STATE_HOME": str(tmp_path)}  # the user's state folder, fresh
    kept = tmp_path / "kvblend" / "prefix"
    svc = Service("", env=env)
    first = svc.status()["shm_prefix"]
    planted.append(f"prefix:{first}")
    assert svc.stop() == 0
    assert re.fullmatch(rf"kvblend_{os.geteuid()}_[0-9a-f]{{16}}", first), first
    assert kept.read_text().strip() == first and kept.stat().st_mode & 0o777 == 0o600

    # another user learnt it (names in /dev/shm are listed to all) and planted the socket's
    # name, which a stopped service leaves free: the next default serve draws another prefix
    squatted = plant_foreign(f"/dev/shm/{first}_dataplane.sock")
    log = tmp_path / "serve.log"
    svc = Service("", env=env, log=log)
    second = svc.status()["shm_prefix"]
    planted.append(f"prefix:{second}")
    assert svc.stop() == 0
    assert second != first and kept.read_text().strip() == second
    assert squatted in log.read_text() and second in log.read_text()

    # the same name under a prefix given with --shm-prefix still stops serve
    before = snapshot(squatted)
    assert_refused(serve(first), squatted)
    assert snapshot(squatted) == before
