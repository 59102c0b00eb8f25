"""The private-file rule (``shm.private``), attacked the way a local user would: symlinks to files
outside /dev/shm, names with group/other bits, names of another uid, planted temp names."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvblend.shm import private
from kvblend.shm.errors import ForeignObject

from ..squat import Squatter, foreign_uid, needs_root, snapshot


@pytest.fixture
def tight_umask() -> Iterator[None]:
    """A umask that takes the owner's write bit away."""
    old = os.umask(0o277)
    yield
    os.umask(old)


def test_open_refuses_a_symlink_and_leaves_its_target(squat: Squatter, outside: Path) -> None:
    path = squat.symlink("_x.lock", str(outside))
    before = snapshot(path), snapshot(str(outside))
    for create in (False, True):
        with pytest.raises(ForeignObject, match="symbolic link"):
            private.open_private(path, create=create)
    with pytest.raises(ForeignObject, match="symbolic link"):
        private.read_private(path)
    assert (snapshot(path), snapshot(str(outside))) == before


def test_open_refuses_group_or_other_bits(squat: Squatter) -> None:
    path = squat.file("_x.lock", mode=0o666)
    before = snapshot(path)
    with pytest.raises(ForeignObject, match="mode 0666"):
        private.open_private(path, create=True)
    assert snapshot(path) == before


def test_open_refuses_another_owner(squat: Squatter) -> None:
    needs_root()
    path = squat.file("_x.lock", uid=foreign_uid())
    before = snapshot(path)
    with pytest.raises(ForeignObject, match=f"belongs to uid {foreign_uid()}"):
        private.open_private(path, create=True)
    with pytest.raises(ForeignObject):
        private.read_private(path)
    assert snapshot(path) == before


def test_open_creates_0600_whatever_the_umask(squat: Squatter, tight_umask: None) -> None:
    fd = private.open_private(squat.path("_x.lock"), create=True)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    finally:
        os.close(fd)


def test_write_replaces_a_symlink_at_the_path_not_its_target(squat: Squatter,
                                                             outside: Path) -> None:
    path = squat.symlink("_dataplane.json", str(outside))
    before = snapshot(str(outside))
    private.write_private(path, b"{}")
    assert snapshot(str(outside)) == before
    assert not os.path.islink(path)
    assert private.read_private(path) == b"{}"


def test_write_never_writes_through_a_planted_temp_name(squat: Squatter, outside: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp name holds 32 random bits; the attacker's lucky guess is granted by fixing them."""
    monkeypatch.setattr(private.secrets, "token_hex", lambda n: "ab" * n)
    path = squat.file("_dataplane.json", data=b"saved")
    link = squat.symlink(f"_dataplane.json.{os.getpid()}.abababab.tmp", str(outside))
    before = snapshot(path), snapshot(link), snapshot(str(outside))
    with pytest.raises(ForeignObject, match="exists"):
        private.write_private(path, b"new")
    assert (snapshot(path), snapshot(link), snapshot(str(outside))) == before


def test_write_ignores_symlinks_at_names_a_naive_writer_would_use(squat: Squatter,
                                                                  outside: Path) -> None:
    path = squat.path("_dataplane.json")
    links = [squat.symlink(f"_dataplane.json{suffix}", str(outside))
             for suffix in (".tmp", f".{os.getpid()}.tmp", ".new", "~")]
    before = snapshot(str(outside))
    private.write_private(path, b"state")
    assert snapshot(str(outside)) == before
    assert all(os.path.islink(link) for link in links)
    assert private.read_private(path) == b"state"


def test_write_is_0600_whatever_the_umask(squat: Squatter, tight_umask: None) -> None:
    path = squat.path("_dataplane.json")
    private.write_private(path, b"state")
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


def test_unlink_checks_every_name_before_removing_any(squat: Squatter, outside: Path) -> None:
    ours = squat.file("_a.lock")
    link = squat.symlink("_b.lock", str(outside))
    loose = squat.file("_c.lock", mode=0o644)
    for other in (link, loose):
        with pytest.raises(ForeignObject):
            private.unlink_private(ours, other)
        assert os.path.lexists(ours) and os.path.lexists(other)
    assert private.unlink_private(ours, squat.path("_absent")) == 1
    assert not os.path.lexists(ours)


def test_check_socket(squat: Squatter) -> None:
    assert not private.check_socket(squat.path("_dataplane.sock"))
    assert private.check_socket(squat.stale_socket("_dataplane.sock"))
    with pytest.raises(ForeignObject, match="not a socket"):
        private.check_socket(squat.file("_file.sock"))


def test_a_socket_of_another_owner_is_foreign(squat: Squatter) -> None:
    needs_root()
    path = squat.stale_socket("_dataplane.sock", uid=foreign_uid())
    with pytest.raises(ForeignObject, match="belongs to uid"):
        private.check_socket(path)
