"""What an attacker on the host does to kvblend's names: plant symlinks, files and sockets under a
prefix before the service uses it, as another uid when the tests run as root.

Every planted name is left for the code under test to refuse; ``Squatter.remove_foreign`` removes
them at teardown (the package's own ``unlink`` refuses to, which is the point).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

TEST_USER = "kvblend-test"


def is_root() -> bool:
    return os.geteuid() == 0


def foreign_uid() -> int:
    """A uid that is not ours, for ``os.chown`` (root only)."""
    try:
        return pwd.getpwnam(TEST_USER).pw_uid
    except KeyError:
        return 65534  # nobody


def needs_root() -> None:
    if not is_root():
        pytest.skip("giving a file to another uid needs root (os.chown)")


@dataclass
class Squatter:
    """Plants names for the code under test to refuse, and removes them afterwards."""

    prefix: str
    planted: list[str] = field(default_factory=list)

    def path(self, suffix: str) -> str:
        return f"/dev/shm/{self.prefix}{suffix}"

    def symlink(self, suffix: str, target: str) -> str:
        path = self.path(suffix)
        os.symlink(target, path)
        return path

    def file(self, suffix: str, mode: int = 0o600, uid: int | None = None,
             data: bytes = b"squatted") -> str:
        path = self.path(suffix)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            if uid is not None:
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
        return path

    def stale_socket(self, suffix: str, uid: int | None = None) -> str:
        """A bound (then closed, so stale) Unix socket, mode 0600."""
        path = self.path(suffix)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            old = os.umask(0o177)
            try:
                s.bind(path)
            finally:
                os.umask(old)
        if uid is not None:
            os.chown(path, uid, -1, follow_symlinks=False)
        return path

    def remove_foreign(self) -> None:
        """Remove every name under the prefix that is not a plain name of ours."""
        for path in glob.glob(f"/dev/shm/{self.prefix}*"):
            st = os.lstat(path)
            if os.path.islink(path) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                os.unlink(path)


def snapshot(path: str) -> tuple[int, int, int, bytes | None]:
    """(kind and mode, uid, inode, contents) of the name itself, to check it was left alone."""
    st = os.lstat(path)
    data = None
    if os.path.islink(path):
        data = os.readlink(path).encode()
    elif os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read()
    return st.st_mode, st.st_uid, st.st_ino, data


@dataclass(frozen=True)
class OtherUser:
    """A second local user that runs small Python programs (no kvblend imports)."""

    name: str
    uid: int
    gid: int
    python: str

    def run(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.python, "-I", "-S", "-c", code, *args], user=self.uid,
                              group=self.gid, extra_groups=[], umask=0o022, cwd="/",
                              capture_output=True, text=True, timeout=60, env={})


def other_user() -> OtherUser:
    """``TEST_USER``, created with useradd when missing; skips when that cannot be done."""
    if not is_root():
        pytest.skip("a second Unix user needs root to create it and to run as it")
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        if not os.path.exists(useradd):
            pytest.skip("useradd is missing: cannot create a second Unix user")
        subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], capture_output=True, timeout=60)
        try:  # another test run may have created it meanwhile: either way it exists now
            entry = pwd.getpwnam(TEST_USER)
        except KeyError:
            pytest.skip(f"useradd could not create {TEST_USER}")
    for python in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
        user = OtherUser(TEST_USER, entry.pw_uid, entry.pw_gid, python)
        if python and _runs(user):
            return user
    pytest.skip(f"no Python interpreter that {TEST_USER} may run")


def _runs(user: OtherUser) -> bool:
    try:
        return user.run("print('ok')").stdout.strip() == "ok"
    except (OSError, subprocess.SubprocessError):
        return False
